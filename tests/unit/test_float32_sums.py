"""A float16 golden's second family of perturbed runs: the same arithmetic with every float16
matmul summed in float32 (``Envelope.float32_sums``), and the target held to the family its
backend computes."""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_judge import layer_like  # the judge's hand-made layer

from pytest_layerparity.backends.cpu import CpuBackend
from pytest_layerparity.backends.cuda import CudaBackend
from pytest_layerparity.backends.neuron import CompiledProgramsBackend, NeuronBackend
from pytest_layerparity.backends.xla import XlaBackend
from pytest_layerparity.compare.envelope import FLOAT32_SUMS, Envelope
from pytest_layerparity.compare.judge import judge
from pytest_layerparity.noise.perturb import PerturbedArithmetic
from pytest_layerparity.noise.perturbed_runs import PerturbedRunner
from pytest_layerparity.options import make_settings
from pytest_layerparity.replay.runner import TargetSide
from pytest_layerparity.report.properties import properties
from pytest_layerparity.store.golden import GoldenEntry


def envelope(scale: float = 1.0) -> Envelope:
    return Envelope(
        noise_ratio=tuple(scale * r for r in (1.0, 1.1, 0.9, 1.05)),
        token_noise_ratio=tuple(scale * r for r in (2.0, 2.2, 1.8, 2.1)),
        contribution_bias=(1.0, -1.0, 2.0, 0.0),
        golden_bias=0.5,
    )


def two_families() -> Envelope:
    return replace(envelope(8.0), float32_sums=replace(envelope(), method=FLOAT32_SUMS))


class _Wide(torch.nn.Module):
    """Two projections with long sums (k = 1024 and 4096), where a float16 sum errs far more
    than one rounding of the float32 sum."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(1024, 4096, bias=False)
        self.down = torch.nn.Linear(4096, 1024, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


CALL = {"args": [{"t": "x"}], "kwargs": {}, "output": {"t": "out"}}


def _family_envelope(dtype: torch.dtype) -> Envelope:
    layer = _Wide().to(dtype)
    x = torch.randn(1, 8, 1024, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        golden = layer(x)
        floor = _Wide().double()(x.double())
    runner = PerturbedRunner(model=SimpleNamespace(top_k=None), golden_dtype=dtype, samples=4)
    env = runner.envelope(0, CALL, {"x": x}, golden, floor, x, layer=layer)
    assert env is not None and runner.sixteen_bit_sums  # the runner's own setting is kept
    return env


def test_a_float16_envelope_holds_runs_summing_in_float32_that_err_less():
    env = _family_envelope(torch.float16)
    wide = env.float32_sums
    assert wide is not None and wide.samples == env.samples == 4 and wide.method == FLOAT32_SUMS
    assert env.relative and wide.relative  # both families' ratios weigh each element's error
    assert wide.float32_sums is None
    # the float16 sums of 1024 and 4096 products err several times one rounding of the float32 sum
    assert statistics.median(env.noise_ratio) > 2 * statistics.median(wide.noise_ratio)
    assert statistics.median(wide.noise_ratio) < 4
    assert Envelope.from_metadata(env.as_metadata()) == env


def test_a_bfloat16_envelope_has_one_family():
    assert _family_envelope(torch.bfloat16).float32_sums is None


@pytest.mark.parametrize("sixteen_bit_sums", [True, False])
def test_a_float16_matmul_sums_in_float16_only_where_the_run_may(sixteen_bit_sums):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(64, 4096, generator=g).half(), torch.randn(4096, 64, generator=g).half()
    rounded = (a.float() @ b.float()).half().float()
    with PerturbedArithmetic(7, sixteen_bit_sums=sixteen_bit_sums):
        out = (a @ b).float()
    rms = ((out - rounded).square().mean() / rounded.square().mean()).sqrt() / torch.finfo(torch.float16).eps
    assert (rms > 2) == sixteen_bit_sums  # in units of float16's ulp at 1


def test_the_families_round_trip_and_a_malformed_second_one_is_refused():
    made = two_families()
    assert Envelope.from_metadata(made.as_metadata()) == made
    old = envelope().as_metadata()
    assert "float32_sums" not in old and Envelope.from_metadata(old).float32_sums is None
    for broken in ([1.0], {"noise_ratio": [1.0]}):
        with pytest.raises(ValueError, match="float32_sums"):
            Envelope.from_metadata({**made.as_metadata(), "float32_sums": broken})


def test_a_target_is_held_to_its_backends_family():
    made = two_families()
    assert made.for_target(True) is made and made.for_target(False) is made.float32_sums
    one = envelope()
    assert one.for_target(False) is one  # a golden with one family: that one
    entry = GoldenEntry("layer_0", Path("layer_00000.safetensors"), {}, {"envelope": made.as_metadata()})
    for backend, family in ((CpuBackend(), made.float32_sums), (SimpleNamespace(sixteen_bit_sums=True), made)):
        assert TargetSide.envelope_of(SimpleNamespace(backend=backend), entry) == family
    without = replace(entry, metadata={})
    assert TargetSide.envelope_of(SimpleNamespace(backend=CpuBackend()), without) is None
    narrow, wide = made.float32_sums.limits(1e-3), made.limits(1e-3)
    assert narrow.max_noise_ratio < wide.max_noise_ratio / 4
    assert "summed in float32" in narrow.describe() and "summed in float32" not in wide.describe()


def test_the_family_a_target_was_held_to_reaches_the_report():
    x, ref, golden = layer_like()
    made = two_families()
    for sixteen_bit_sums, method in ((False, FLOAT32_SUMS), (True, "mca")):
        envelope = made.for_target(sixteen_bit_sums)
        outcome = judge(0, golden, golden, make_settings(), "float32", floor=ref, hidden_in=x, envelope=envelope)
        assert dict(properties(outcome))["envelope_method"] == method


@pytest.mark.parametrize(
    ("pjrt", "sixteen_bit_sums"), [("CPU", True), ("cpu", True), ("TPU", False), ("NEURON", False), ("OTHER", True)]
)
def test_which_devices_may_sum_float16_in_float16(monkeypatch, pjrt, sixteen_bit_sums):
    monkeypatch.setenv("PJRT_DEVICE", pjrt)
    assert XlaBackend().sixteen_bit_sums is sixteen_bit_sums
    for backend in (CpuBackend(), CudaBackend(), NeuronBackend(), CompiledProgramsBackend()):
        assert backend.sixteen_bit_sums is False
