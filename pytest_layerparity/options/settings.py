"""The settings a run works from: every option's effective value, one field per entry of the
table, and what they add up to (the run's mode, its target)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from .table import OPTIONS


class RunMode(str, Enum):
    """What a session does. A str, so that text and reports show the plain name."""

    EXTRACT = "extract"  # write the goldens
    VERIFY = "verify"  # re-run the reference against the store
    PARITY = "parity"  # test the port against the goldens

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


@dataclass(frozen=True)
class Settings:
    """Every option's effective value, one field per option."""

    # One field per entry of OPTIONS, in its order (the unit tests hold the two together); plain
    # values: the command line's over the ini's over the default.
    gpu_golden: bool
    extract: bool
    golden_device: str
    xla: bool
    neuron: bool
    target: str | None
    port: str | None
    nxdi_app: str | None
    model: str | None
    golden_dir: str | None
    layers: str
    layer_ranges: str | None
    layer_module: str | None
    seq_len: int
    decode_steps: int
    logits_topk: int
    batch_size: int
    seed: int
    prompt: str | None
    dtype: str | None
    max_abs_diff: float
    max_mean_abs_diff: float
    min_similarity: float
    min_cosine: float | None
    min_pearson: float
    verdict: str
    max_noise_ratio: float | None
    max_token_noise_ratio: float | None
    max_contribution_z: float | None
    false_alarm_rate: float
    envelope_samples: int
    near_ties: str
    router_tie_tolerance: float
    no_precision_floor: bool
    force_regen: bool
    device_map: str | None
    max_memory: str | None
    offload_folder: str | None
    plan: bool
    parity_report: str | None
    save_outputs: str | None
    chain: bool
    bisect: bool
    op_compare: bool
    op_compare_dir: str | None
    op_atol: float | None
    op_rtol: float | None
    tp_degree: int
    ep_degree: int
    logical_nc_config: int | None
    experts_implementation: str | None
    attn_implementation: str | None
    trust_remote_code: bool
    cores_per_worker: int
    compile_cache: str | None

    @property
    def target_name(self) -> str | None:
        if self.xla:
            return "xla"
        if self.neuron:
            return "neuron"
        return self.target

    @property
    def compiled(self) -> bool:
        """NxDI's port compiled through build_module, one program per layer kind (--port nxdi --target neuron)."""
        return self.port == "nxdi" and self.target_name == "neuron"

    @property
    def mode(self) -> RunMode | None:
        """Extract, verify (re-run the reference against the store), parity or None."""
        if self.gpu_golden:
            return RunMode.EXTRACT if self.extract else RunMode.VERIFY
        if self.target_name:
            return RunMode.PARITY
        return None


def make_settings(**values: Any) -> Settings:
    """Settings with every option at its default except ``values`` (for use without pytest:
    scripts, benchmarks, ``python -m pytest_layerparity``)."""
    base = {opt.dest: opt.default for opt in OPTIONS}
    unknown = set(values) - set(base)
    if unknown:
        raise TypeError(f"unknown settings: {', '.join(sorted(unknown))}")
    base.update(values)
    if base["port"] is None:
        base["port"] = default_port(base["target"], base["xla"], base["neuron"], own_port=False)
    return Settings(**base)


def default_port(target: str | None, xla: bool, neuron: bool, own_port: bool) -> str:
    """The port under test when --port is not given: NxDI's on Neuron (``--neuron`` is
    ``--port nxdi --target neuron``), except where a conftest supplies its own layer."""
    on_neuron = neuron or (target == "neuron" and not xla)
    return "nxdi" if on_neuron and not own_port else "hf"
