"""Command-line options and ini keys: the one table of options, the settings they make, and
the small pure functions that parse each value and raise with the fix.

Everything that reads an option reads it here (:func:`read_settings`), the plugin and the
distributed runs alike.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import pytest

DTYPES = ("bfloat16", "float16", "float32")
GOLDEN_DEVICES_HELP = "auto, cpu, cuda or cuda:N"
DEVICE_MAP_CHOICES = ("stream", "auto", "balanced", "balanced_low_0", "sequential", "cpu")
MAX_MEMORY_FORMS = (
    "40GB (every GPU), 0:60GB,1:60GB,2:40GB (per GPU), cpu:100GB (host), units B/KB/MB/GB/TB or KiB/MiB/GiB/TiB"
)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "B": 1,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number; give a positive integer such as 32"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer (1 or more)")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give 0 or more") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if math.isnan(value) or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def tolerance(text: str) -> float:
    """A difference bound: finite and >= 0."""
    value = _finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative; a tolerance is 0 or more (e.g. 0.01)")
    return value


def probability(text: str) -> float:
    """A false-alarm rate: strictly between 0 and 0.5."""
    value = _finite_float(text)
    if not 0 < value < 0.5:
        raise argparse.ArgumentTypeError(f"{text!r} is not a probability between 0 and 0.5 (e.g. 0.001)")
    return value


def percentage(text: str) -> float:
    value = _finite_float(text)
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage between 0 and 100 (e.g. 95)")
    return value


def correlation(text: str) -> float:
    value = _finite_float(text)
    if not -1 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not between -1 and 1 (e.g. 0.99)")
    return value


def dtype_name(text: str) -> str:
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    value = aliases.get(text.strip().lower(), text.strip().lower())
    if value not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a supported dtype; choose one of {', '.join(DTYPES)}")
    return value


def golden_device(text: str) -> str:
    value = text.strip().lower()
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"{text!r} is not a golden device; choose {GOLDEN_DEVICES_HELP}")


def size_bytes(text: str) -> int:
    """``40GB`` -> 40_000_000_000; ValueError for anything else."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(text)
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def max_memory_spec(text: str) -> str:
    """argparse type of --max-memory: checks the form, keeps the text."""
    try:
        parse_max_memory(text, gpus=1)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a memory budget ({exc}); accepted forms: {MAX_MEMORY_FORMS}"
        ) from None
    return text


def parse_max_memory(text: str, gpus: int | None = None) -> dict[int | str, str]:
    """'40GB' -> every visible GPU gets 40GB; '0:60GB,1:40GB,cpu:100GB' -> per device
    (accelerate's ``max_memory``)."""
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError("empty")
    if len(parts) == 1 and ":" not in parts[0]:
        size_bytes(parts[0])
        return dict.fromkeys(range(gpus), parts[0]) if gpus else {"cpu": parts[0]}
    out: dict[int | str, str] = {}
    for part in parts:
        if ":" not in part:
            raise ValueError(f"{part!r} has no device; write DEVICE:SIZE")
        device, size = (x.strip() for x in part.split(":", 1))
        size_bytes(size)
        if device.lower() == "cpu":
            out["cpu"] = size
        elif device.isdigit():
            out[int(device)] = size
        else:
            raise ValueError(f"{device!r} is not a GPU index or cpu")
    return out


def device_map_choice(text: str) -> str:
    value = text.strip()
    if value in DEVICE_MAP_CHOICES or re.fullmatch(r"cuda:\d+", value):
        return value
    raise argparse.ArgumentTypeError(f"{text!r} is not a device map; choose {', '.join(DEVICE_MAP_CHOICES)} or cuda:N")


@dataclass(frozen=True)
class Option:
    """One option: its flag, its ini key (if it persists between runs), parser and default."""

    dest: str
    flag: str
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    ini: bool = False
    action: str | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @property
    def ini_name(self) -> str:
        return f"layerparity_{self.dest}"


OPTIONS = (
    Option(
        "gpu_golden",
        "--gpu-golden",
        "Run the reference model (CUDA when visible, else CPU). With --extract, write goldens; without, check the "
        "stored goldens reproduce.",
        action="store_true",
        default=False,
    ),
    Option(
        "extract",
        "--extract",
        "With --gpu-golden: write golden references for the selected layers.",
        action="store_true",
        default=False,
    ),
    Option(
        "golden_device",
        "--golden-device",
        f"Device of the reference run: {GOLDEN_DEVICES_HELP}. Default: auto.",
        type=golden_device,
        default="auto",
        ini=True,
        metavar="DEVICE",
    ),
    Option(
        "xla",
        "--xla",
        "Run each layer on the torch-xla device (same as --target xla).",
        action="store_true",
        default=False,
    ),
    Option(
        "neuron",
        "--neuron",
        "Test NxDI's port of the architecture compiled for NeuronCores (same as --port nxdi --target neuron; "
        "with a conftest's pytest_layerparity_build_target_layer, or --port hf, its port runs eagerly on the "
        "NeuronCore through torch-neuronx).",
        action="store_true",
        default=False,
    ),
    Option(
        "target",
        "--target",
        "Device to test the port on. Default: none (no parity tests).",
        choices=("cpu", "cuda", "xla", "neuron"),
        default=None,
    ),
    Option(
        "port",
        "--port",
        "Whose implementation of each layer is under test: hf (the model's own HuggingFace layer, or the port a "
        "conftest's build hook returns) or nxdi (the neuronx-distributed-inference port of the architecture, built "
        "as NxDI builds it: with --target cpu eagerly in NxD's CPU mode, with --target neuron compiled through NxDI's "
        "build_module). Default: nxdi with --neuron (or --target neuron), unless a conftest implements "
        "pytest_layerparity_build_target_layer (then hf: the conftest's own port); hf otherwise.",
        choices=("hf", "nxdi"),
        default=None,
        ini=True,
    ),
    Option(
        "nxdi_app",
        "--nxdi-app",
        "With --port nxdi: the NxDI application class of a port outside NxDI's tree (package.module:Class, e.g. a "
        "contributed model's NeuronMiniMaxM2ForCausalLM). Default: NxDI's class for the model_type.",
        default=None,
        ini=True,
        metavar="MODULE:CLASS",
    ),
    Option(
        "model",
        "--model",
        "HuggingFace model folder (config.json + safetensors). Default: ini layerparity_model.",
        default=None,
        ini=True,
        metavar="DIR",
    ),
    Option(
        "golden_dir",
        "--golden-dir",
        "Golden store folder. Default: ini layerparity_golden_dir, else layerparity-goldens/<model folder name>.",
        default=None,
        ini=True,
        metavar="DIR",
    ),
    Option(
        "layers",
        "--layers",
        "Layers to test: 17, 0-30, 0-5,10,20-25 or all. Default: all.",
        default="all",
        ini=True,
        metavar="SPEC",
    ),
    Option(
        "layer_ranges",
        "--layer-ranges",
        "Also test ranges run end to end from the golden input of their first layer, e.g. 0-5,6-11. Default: none.",
        default=None,
        metavar="SPEC",
    ),
    Option(
        "layer_module",
        "--layer-module",
        "Dotted path of the layer list when it is not found automatically (e.g. encoder.layer). Default: found "
        "automatically.",
        default=None,
        ini=True,
        metavar="PATH",
    ),
    Option(
        "seq_len",
        "--seq-len",
        "Tokens per sequence of the golden input. Default: 32.",
        type=positive_int,
        default=32,
        ini=True,
        metavar="N",
    ),
    Option(
        "decode_steps",
        "--decode-steps",
        "Extraction: after the prompt, run N greedy decode steps (one token each, with the KV cache) and store "
        "every selected layer's call in each step, for the decode-step tests. 0: prompt only. Default: 2.",
        type=non_negative_int,
        default=2,
        ini=True,
        metavar="N",
    ),
    Option(
        "logits_topk",
        "--logits-topk",
        "Extraction: keep the model's next-token logits at every prompt and decode position as the top-K ids and "
        "logits plus the log-sum-exp, with their noise envelope, for test_model_parity (whole model, not under "
        "--device-map stream). 0: no whole-model golden. Default: 16.",
        type=non_negative_int,
        default=16,
        ini=True,
        metavar="K",
    ),
    Option(
        "batch_size",
        "--batch-size",
        "Sequences in the golden input. Default: 1.",
        type=positive_int,
        default=1,
        ini=True,
        metavar="N",
    ),
    Option(
        "seed",
        "--seed",
        "Seed of the golden input token ids. Default: 0.",
        type=non_negative_int,
        default=0,
        ini=True,
        metavar="N",
    ),
    Option(
        "prompt",
        "--prompt",
        "Use this text through the model's tokenizer as the golden input instead of random token ids. Default: none.",
        default=None,
        metavar="TEXT",
    ),
    Option(
        "dtype",
        "--dtype",
        f"Dtype of the reference run and the port: {', '.join(DTYPES)}. Default: the checkpoint's own (dtype or "
        "torch_dtype in config.json, as transformers' 'auto' reads it; float32 when it names none); the stored "
        "golden's dtype when testing.",
        type=dtype_name,
        default=None,
        ini=True,
    ),
    Option(
        "max_abs_diff",
        "--max-abs-diff",
        "Fail when max_abs_diff is above this. Default: 0.01.",
        type=tolerance,
        default=0.01,
        ini=True,
        metavar="X",
    ),
    Option(
        "max_mean_abs_diff",
        "--max-mean-abs-diff",
        "Fail when mean_abs_diff is above this. Default: 0.001.",
        type=tolerance,
        default=0.001,
        ini=True,
        metavar="X",
    ),
    Option(
        "min_similarity",
        "--min-similarity",
        "Fail when similarity_percentage (share of elements with |target - golden| <= 0.01 + 0.01 * |golden|) is "
        "below this. Default: 95.",
        type=percentage,
        default=95.0,
        ini=True,
        metavar="PCT",
    ),
    Option(
        "min_cosine",
        "--min-cosine",
        "Fail when cosine_similarity is below this. Default: 0.99 (noise policy, float32 goldens: 0.9999).",
        type=correlation,
        default=None,
        ini=True,
        metavar="X",
    ),
    Option(
        "min_pearson",
        "--min-pearson",
        "Fail when pearson_correlation is below this. Default: 0.99.",
        type=correlation,
        default=0.99,
        ini=True,
        metavar="X",
    ),
    Option(
        "verdict",
        "--verdict",
        "Verdict policy: noise (error in units of the golden's own rounding error, against the stored float32 "
        "evaluation) or table (the fixed thresholds above). Default: noise.",
        choices=("noise", "table"),
        default="noise",
        ini=True,
    ),
    Option(
        "max_noise_ratio",
        "--max-noise-ratio",
        "Noise policy: fail when ||target - ref|| / ||golden - ref|| is above this. Default: 1.5.",
        type=tolerance,
        default=None,
        ini=True,
        metavar="X",
    ),
    Option(
        "max_token_noise_ratio",
        "--max-token-noise-ratio",
        "Noise policy: fail when any token's noise ratio is above this. Default: 3.",
        type=tolerance,
        default=None,
        ini=True,
        metavar="X",
    ),
    Option(
        "max_contribution_z",
        "--max-contribution-bias",
        "Noise policy: fail when the target's error along the layer's own contribution (output - input) is more than "
        "this many noise units. Default: 6.",
        type=tolerance,
        default=None,
        ini=True,
        metavar="Z",
    ),
    Option(
        "false_alarm_rate",
        "--false-alarm-rate",
        "Noise policy: the probability that a correct layer fails, from which the limits are drawn out of the "
        "layer's noise envelope. Default: 0.001.",
        type=probability,
        default=1e-3,
        ini=True,
        metavar="P",
    ),
    Option(
        "envelope_samples",
        "--envelope-samples",
        "Perturbed runs (Monte Carlo arithmetic) of each layer that make its noise envelope, at extraction and "
        "for each chained run; 0: none (fixed limits). Default: 12.",
        type=non_negative_int,
        default=12,
        ini=True,
        metavar="K",
    ),
    Option(
        "exclude_near_ties",
        "--exclude-near-ties",
        "Leave tokens whose MoE routing flipped on a near tie out of the output metrics.",
        action="store_true",
        default=False,
    ),
    Option(
        "strict_routing",
        "--strict-routing",
        "Count tokens whose MoE routing flipped on a near tie in the verdict too (by default the noise policy leaves "
        "them out and reports them).",
        action="store_true",
        default=False,
    ),
    Option(
        "router_tie_tolerance",
        "--router-tie-tolerance",
        "A router margin (gap between the k-th and k+1-th logit over the largest) below this many units of the "
        "dtype's epsilon is a near tie. Default: 8.",
        type=tolerance,
        default=8.0,
        ini=True,
        metavar="N",
    ),
    Option(
        "no_precision_floor",
        "--no-precision-floor",
        "Extraction: skip the higher-precision evaluation of each layer (the noise policy then falls back to the "
        "table policy for these goldens).",
        action="store_true",
        default=False,
    ),
    Option(
        "force_regen",
        "--force-regen",
        "Extraction: replace the golden store with this extraction even when it holds goldens of another one; the "
        "old store is kept aside (DIR.previous) until every extraction test has passed, and put back otherwise.",
        action="store_true",
        default=False,
    ),
    Option(
        "device_map",
        "--device-map",
        "Placement of the reference model: stream (one layer at a time from the shards), auto, balanced, "
        "balanced_low_0, sequential, cpu or cuda:N (whole model through accelerate). Default: whole model on the "
        "golden device when it fits, else stream.",
        type=device_map_choice,
        default=None,
        ini=True,
        metavar="MAP",
    ),
    Option(
        "max_memory",
        "--max-memory",
        "Memory budget per device for whole-model placement: 40GB, 0:60GB,1:60GB,2:40GB or cpu:100GB. Default: what "
        "is free.",
        type=max_memory_spec,
        default=None,
        ini=True,
        metavar="SPEC",
    ),
    Option(
        "offload_folder",
        "--offload-folder",
        "Folder for weights accelerate offloads to disk in whole-model placement. Default: none.",
        default=None,
        ini=True,
        metavar="DIR",
    ),
    Option(
        "plan",
        "--plan",
        "Print the memory plan (weights by dtype, largest layer, activations, KV cache, devices, which placement "
        "fits) from config.json and the safetensors headers, and exit.",
        action="store_true",
        default=False,
    ),
    Option(
        "parity_report",
        "--parity-report",
        "Write report.json, report.csv and report.html (table and metric plots across layers) into this folder. "
        "Default: none.",
        default=None,
        metavar="DIR",
    ),
    Option(
        "save_outputs",
        "--save-outputs",
        "Keep the target's per-layer outputs in this folder, in the golden format (for python -m pytest_layerparity "
        "compare). Default: none.",
        default=None,
        metavar="DIR",
    ),
    Option(
        "chain",
        "--chain",
        "Also run the selected layers as chains on the target (each contiguous run, fed the target's own output), "
        "comparing every layer: the accumulated drift.",
        action="store_true",
        default=False,
    ),
    Option(
        "bisect",
        "--bisect",
        "Also bisect each contiguous run of selected layers to the first layer whose chained output leaves "
        "tolerance, in O(log n) chained range runs.",
        action="store_true",
        default=False,
    ),
    Option(
        "op_compare",
        "--op-compare",
        "Re-run each failing layer op by op under CompareWithCPU (target device against the CPU) with the module "
        "tracker, and report the first op that fails, its module path and the command that replays its dump.",
        action="store_true",
        default=False,
    ),
    Option(
        "op_compare_dir",
        "--op-compare-dir",
        "Where --op-compare writes the failing op's dump. Default: layerparity-opcompare/.",
        default=None,
        ini=True,
        metavar="DIR",
    ),
    Option(
        "op_atol",
        "--op-atol",
        "--op-compare: absolute tolerance of one op against the CPU. Default: per dtype (bf16 1e-2, fp16 1e-3, fp32 "
        "1e-4).",
        type=tolerance,
        default=None,
        ini=True,
        metavar="X",
    ),
    Option(
        "op_rtol",
        "--op-rtol",
        "--op-compare: relative tolerance of one op against the CPU. Default: per dtype (bf16 1.6e-2, fp16 1e-3, "
        "fp32 1e-4).",
        type=tolerance,
        default=None,
        ini=True,
        metavar="X",
    ),
    Option(
        "tp_degree",
        "--tp-degree",
        "Tensor-parallel degree: of NxDI's layers sharded over torchrun ranks in NxD's CPU mode (--port nxdi --target "
        "cpu: one rank per shard), of a layer run eagerly on Neuron (--neuron --port hf: neuronx-distributed "
        "parallel_state; one torchrun rank per NeuronCore), "
        "or of each program compiled under --port nxdi --target neuron (one process over N NeuronCores). Default: 1.",
        type=positive_int,
        default=1,
        ini=True,
        metavar="N",
    ),
    Option(
        "ep_degree",
        "--ep-degree",
        "With --port nxdi --target neuron: expert parallelism of a MoE port's compiled programs (NxDI's "
        "moe_ep_degree; the experts' tensor parallelism is then --tp-degree / N). Not in NxD's CPU mode, which "
        "makes no expert-parallel groups. Default: 1.",
        type=positive_int,
        default=1,
        ini=True,
        metavar="N",
    ),
    Option(
        "logical_nc_config",
        "--logical-nc-config",
        "With --port nxdi --target neuron: NxDI's logical_nc_config of the compiled programs (2 on Trn2 with "
        "LNC2). Default: NxDI's NeuronConfig default.",
        type=positive_int,
        default=None,
        ini=True,
        metavar="N",
    ),
    Option(
        "experts_implementation",
        "--experts-implementation",
        "MoE experts implementation of the layers built for the target (transformers': eager, batched_mm, "
        "grouped_mm). Default: eager on torch-xla and Neuron (grouped_mm does not run there), the model's elsewhere.",
        default=None,
        ini=True,
        metavar="NAME",
    ),
    Option(
        "attn_implementation",
        "--attn-implementation",
        "Attention implementation of the reference model (eager, sdpa, ...). Default: the model's.",
        default=None,
        ini=True,
        metavar="NAME",
    ),
    Option(
        "trust_remote_code",
        "--trust-remote-code",
        "Allow the model folder's own modeling code (transformers trust_remote_code).",
        action="store_true",
        default=False,
    ),
    Option(
        "cores_per_worker",
        "--cores-per-worker",
        "With -n N and --neuron: NeuronCores each xdist worker gets (NEURON_RT_VISIBLE_CORES, taken in order from "
        "the visible cores); 0 leaves a single worker unpinned (refused with several). Default: 1.",
        type=non_negative_int,
        default=1,
        ini=True,
        metavar="N",
    ),
    Option(
        "compile_cache",
        "--compile-cache",
        "Keep compiled graphs in this folder between sessions: torch-xla's persistent cache with --xla, Neuron's "
        "compile cache (NEURON_COMPILE_CACHE_URL) with --neuron. Default: none.",
        default=None,
        ini=True,
        metavar="DIR",
    ),
)


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("layerparity", "per-layer parity of model ports (pytest-layerparity)")
    for opt in OPTIONS:
        kwargs: dict[str, Any] = {"dest": f"layerparity_{opt.dest}", "help": opt.help}
        if opt.action:
            kwargs["action"] = opt.action
            kwargs["default"] = opt.default
        else:
            kwargs["default"] = None  # None means "not given": the ini key or the default applies
            if opt.type is not None:
                kwargs["type"] = opt.type
            if opt.choices:
                kwargs["choices"] = opt.choices
            if opt.metavar:
                kwargs["metavar"] = opt.metavar
        group.addoption(opt.flag, **kwargs)
        if opt.ini:
            parser.addini(opt.ini_name, help=f"Default of {opt.flag}: {opt.help}", default=None)


@dataclass(frozen=True)
class Settings:
    """Every option's effective value (command line over ini over default); plain values."""

    gpu_golden: bool
    extract: bool
    golden_device: str
    xla: bool
    neuron: bool
    target: str | None
    port: str
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
    exclude_near_ties: bool
    strict_routing: bool
    router_tie_tolerance: float
    no_precision_floor: bool
    force_regen: bool
    device_map: str | None
    max_memory: str | None
    offload_folder: str | None
    plan: bool
    parity_report: str | None
    save_outputs: str | None
    op_compare: bool
    op_compare_dir: str | None
    op_atol: float | None
    op_rtol: float | None
    chain: bool
    bisect: bool
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
    def mode(self) -> str | None:
        """'extract', 'verify' (re-run the reference against the store), 'parity' or None."""
        if self.gpu_golden:
            return "extract" if self.extract else "verify"
        if self.target_name:
            return "parity"
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


def conftest_builds_layer(config: pytest.Config) -> bool:
    """Whether a conftest (or plugin) implements ``pytest_layerparity_build_target_layer``:
    its own port of the layer."""
    hook = getattr(config.pluginmanager.hook, "pytest_layerparity_build_target_layer", None)
    return bool(hook is not None and hook.get_hookimpls())


def read_settings(config: pytest.Config) -> Settings:
    values = {}
    for opt in OPTIONS:
        value = config.getoption(f"layerparity_{opt.dest}")
        if value is None and opt.ini:
            raw = config.getini(opt.ini_name)
            if raw not in (None, "", []):
                value = _parse_ini(opt, raw)
        values[opt.dest] = opt.default if value is None else value
    if values["port"] is None:
        own = conftest_builds_layer(config)
        values["port"] = default_port(values["target"], values["xla"], values["neuron"], own)
    names = {f.name for f in fields(Settings)}
    return Settings(**{k: v for k, v in values.items() if k in names})


PATH_OPTIONS = (
    "model",
    "golden_dir",
    "parity_report",
    "save_outputs",
    "offload_folder",
    "op_compare_dir",
    "compile_cache",
)


def is_url(location: str) -> bool:
    return "://" in location


def resolve_cache_location(value: str, base: Path) -> str:
    """A local folder made absolute against ``base``; URLs (s3://, for Neuron's compile
    cache) are kept as they are."""
    if is_url(value) or Path(value).is_absolute():
        return value
    return str(base / value)


def resolve_paths(settings: Settings, config: pytest.Config) -> Settings:
    """Make path options absolute: command-line values against the directory pytest was
    started in, ini values against the ini file's directory (URLs stay as they are)."""
    changes = {}
    for dest in PATH_OPTIONS:
        value = getattr(settings, dest)
        if not value:
            continue
        from_cli = config.getoption(f"layerparity_{dest}") is not None
        base = config.invocation_params.dir if from_cli or config.inipath is None else config.inipath.parent
        resolved = resolve_cache_location(value, Path(base))
        if resolved != value:
            changes[dest] = resolved
    return replace(settings, **changes)


INI_FILES = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")


def check_ini_not_lost(config: pytest.Config) -> None:
    """Refuse a run whose ini file pytest skipped because of how a path option was written.

    pytest chooses its rootdir and ini file before plugins' options are known, so in
    ``--golden-dir /data/goldens`` it takes ``/data/goldens`` for a test path, looks for an
    ini above it, and (finding none) runs without the project's ``layerparity_*`` settings.
    """
    if config.inipath is not None:
        return
    by_flag = {opt.flag: opt for opt in OPTIONS if opt.dest in PATH_OPTIONS}
    args = list(config.invocation_params.args)
    split = [
        (flag, args[i + 1])
        for i, flag in enumerate(args[:-1])
        if flag in by_flag and Path(config.invocation_params.dir, args[i + 1]).exists()
    ]
    if not split:
        return
    start = Path(config.invocation_params.dir)
    for folder in (start, *start.parents):
        for name in INI_FILES:
            ini = folder / name
            try:
                text = ini.read_text(errors="replace") if ini.is_file() else ""
            except OSError:
                continue
            if "layerparity_" in text:
                flag, value = split[0]
                raise pytest.UsageError(
                    f"pytest read no ini file: it took {value} (the value of {flag}) for a test path when it "
                    "chose its rootdir, which it does before plugins' options are known, so the layerparity "
                    f"settings in {ini} were not read; write {flag}={value}, or add -c {ini}"
                )


def current_settings(config: pytest.Config) -> Settings:
    """The session's settings: every option read (command line over ini over default), paths
    made absolute, contradictions refused."""
    check_ini_not_lost(config)
    settings = resolve_paths(read_settings(config), config)
    check_combinations(settings)
    return settings


def _parse_ini(opt: Option, raw: Any) -> Any:
    text = raw if isinstance(raw, str) else str(raw)
    if opt.type is None:
        return text
    try:
        return opt.type(text)
    except argparse.ArgumentTypeError as exc:
        raise pytest.UsageError(f"ini option {opt.ini_name} = {text!r}: {exc}") from None


def check_combinations(settings: Settings) -> None:
    """Raise UsageError for options that contradict each other, saying what to type instead."""
    chosen = [
        flag
        for flag, on in (
            ("--xla", settings.xla),
            ("--neuron", settings.neuron),
            (f"--target {settings.target}", settings.target),
        )
        if on
    ]
    if len(chosen) > 1:
        raise pytest.UsageError(
            f"{' and '.join(chosen)} name different targets; choose one: --xla, --neuron or --target NAME"
        )
    if settings.port == "nxdi" and settings.target_name not in (None, "cpu", "neuron"):
        raise pytest.UsageError(
            f"--port nxdi runs NxDI's layers eagerly on the CPU in NxD's CPU mode (--target cpu) or compiled for "
            f"NeuronCores (--target neuron), not on --target {settings.target_name}"
        )
    if settings.ep_degree > 1:
        check_ep_degree(settings)
    if settings.logical_nc_config is not None and not settings.compiled:
        raise pytest.UsageError(
            "--logical-nc-config sets the programs NxDI compiles: use it with --port nxdi --target neuron"
        )
    if settings.nxdi_app and settings.port != "nxdi":
        raise pytest.UsageError("--nxdi-app names the NxDI application class of --port nxdi: add --port nxdi")
    if settings.envelope_samples == 1:
        raise pytest.UsageError(
            "--envelope-samples 1 cannot show a spread: give 2 or more perturbed runs (e.g. 12), or 0 for none"
        )
    if settings.force_regen and settings.mode != "extract":
        raise pytest.UsageError(
            "--force-regen replaces a golden store by a new extraction: use it with --gpu-golden --extract"
        )
    if settings.extract and not settings.gpu_golden:
        raise pytest.UsageError("--extract writes goldens from the reference run: use --gpu-golden --extract")
    if settings.gpu_golden and settings.target_name:
        raise pytest.UsageError(
            f"--gpu-golden runs the reference and --{settings.target_name} the port; run them as two sessions: "
            f"pytest --gpu-golden --extract, then pytest --{settings.target_name}"
        )
    for flag, on in (
        ("--layer-ranges", settings.layer_ranges),
        ("--chain", settings.chain),
        ("--bisect", settings.bisect),
    ):
        if on and settings.mode != "parity":
            raise pytest.UsageError(f"{flag} runs layers on a target: add --xla, --neuron or --target NAME")


def check_ep_degree(settings: Settings) -> None:
    """Expert parallelism is NxDI's, compiled: refused where it cannot run (never run as plain
    tensor parallelism under the option's name)."""
    ep, tp = settings.ep_degree, settings.tp_degree
    if settings.port != "nxdi":
        raise pytest.UsageError(f"--ep-degree {ep} shards the experts of NxDI's MoE layers: use it with --port nxdi")
    if not settings.compiled:
        raise pytest.UsageError(
            f"--ep-degree {ep}: NxD's CPU mode has no expert parallelism (neuronx-distributed makes its MoE "
            "expert-parallel process groups the XLA way only: 'ProcessGroup' object has no attribute '_mesh'; with "
            "moe_ep_degree > 1 NxDI would run plain tensor parallelism instead); on the CPU the experts are sharded "
            "by --tp-degree alone: drop --ep-degree, or test it compiled with --port nxdi --target neuron"
        )
    if tp % ep:
        raise pytest.UsageError(
            f"--ep-degree {ep} must divide --tp-degree {tp}: NxDI shards the experts over moe_ep_degree x "
            "moe_tp_degree = tp_degree ranks"
        )
