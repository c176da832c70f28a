"""Tests of pytest_layerparity.ops on real devices: the CPU and torch-xla
(PJRT_DEVICE=CPU).

How errors are planted (honestly): CompareWithCPU re-runs each op on the CPU
with the same inputs, so a model that merely computes something different on
the device (``x * 1.01`` only when on xla) would still pass op by op: the
device ``mul`` and the CPU ``mul`` agree.  What the tool catches is a wrong
*kernel*.  So the tests register, for the XLA dispatch key only, a
deliberately wrong kernel for a real aten op (``aten::addmm``: the correct
result times 1.01) through ``torch.library``, and remove it again at teardown
(the original XLA kernel comes back).  The CPU kernel is untouched, so the
op's device result differs from its CPU result by ~1%, exactly like a buggy
accelerator kernel, and the failure can be reproduced from a dump as long as
the wrong kernel is registered (and disappears once it is removed).
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import warnings

os.environ.setdefault("PJRT_DEVICE", "CPU")

import pytest
import torch
from torch import nn

from pytest_layerparity.ops import (
    DEFAULT_WHITE_LIST,
    CompareError,
    CompareWithCPU,
    DumpFormatError,
    ModuleInfo,
    NanInfError,
    NanInfTracker,
    compare_for_single_op,
    load_op_dump,
    nan_inf_track_for_single_op,
    open_module_tracker,
    resolve_op,
)
from pytest_layerparity.ops._names import OpMatcher

LOGGER = "pytest_layerparity.ops"


# ------------------------------------------------------------------ models --
class Attention(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        return torch.softmax(self.proj(x), dim=-1)


class MLP(nn.Module):
    def __init__(self, d: int = 8, shift: float = 0.0):
        super().__init__()
        self.up = nn.Linear(d, d)
        self.shift = shift

    def forward(self, x):
        h = self.up(x)
        # log of (h - shift): NaN for h < shift, the planted NaN source
        return torch.log(h - self.shift) if self.shift else torch.relu(h)


class DecoderLayer(nn.Module):
    def __init__(self, d: int = 8, shift: float = 0.0):
        super().__init__()
        self.attn = Attention(d)
        self.mlp = MLP(d, shift)

    def forward(self, x):
        h = self.attn(x) + x
        return self.mlp(h) * 2.0 + h


@pytest.fixture(autouse=True)
def _clean_module_stack():
    ModuleInfo.reset()
    yield
    ModuleInfo.reset()


@pytest.fixture(scope="module")
def xla():
    torch_xla = pytest.importorskip("torch_xla")
    return torch_xla.device()


def _destroy(lib) -> None:
    if hasattr(lib, "_destroy"):
        lib._destroy()
    del lib
    gc.collect()


@pytest.fixture
def wrong_xla_addmm(xla):
    """Registers a wrong aten::addmm kernel for the XLA key (1% too large)."""
    lib = torch.library.Library("aten", "IMPL")

    def bad_addmm(bias, a, b, *, beta=1, alpha=1):
        return (torch.ops.aten.mm.default(a, b) * alpha + bias * beta) * 1.01

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.impl("addmm", bad_addmm, "XLA")
    yield
    _destroy(lib)


def _model(device, shift: float = 0.0, seed: int = 0):
    torch.manual_seed(seed)
    return DecoderLayer(8, shift).to(device)


def _x(device, seed: int = 1, shape=(4, 8)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device)


# ------------------------------------------------- (1) planted wrong op ---
def test_planted_wrong_op_is_named_with_module_path(xla, wrong_xla_addmm, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = _model(xla)
    handle = open_module_tracker(model)
    try:
        with torch.no_grad(), CompareWithCPU(atol=1e-3, rtol=1e-3, verbose=True) as cmp:
            out = model(_x(xla))
    finally:
        handle.remove()
    assert out.device.type == "xla"
    first = cmp.first_failure
    assert first is not None
    assert first.op_name == "torch.ops.aten.addmm"
    assert first.overload == "aten::addmm.default"
    assert first.module_path == "DecoderLayer/Attention/Linear"
    assert first.module_qualname == "attn.proj"
    assert first.phase == "forward" and first.step == 0 and first.device == "xla:0"
    assert first.max_abs_diff > 1e-3 and first.num_bad > 0 and first.first_bad_index is not None
    # only the addmm ops fail (the Attention one first, then the MLP one)
    assert [f.module_path for f in cmp.failures] == ["DecoderLayer/Attention/Linear", "DecoderLayer/MLP/Linear"]
    assert {f.op_name for f in cmp.failures} == {"torch.ops.aten.addmm"}
    assert cmp.stats["passed"] > 0
    text = caplog.text
    assert (
        "[ERROR] DecoderLayer/Attention/Linear/torch.ops.aten.addmm(forward) fails to pass CompareWithCPU test" in text
    )
    assert "....... input ........." in text and "...... compare with cpu ......." in text
    assert "Tensor values are not close" in text
    assert "Element at index (0, 0) is not close:" in text and "(xla:0) vs " in text
    assert "DecoderLayer/Attention/torch.ops.aten._softmax(forward) succeeds to pass CompareWithCPU test" in text
    assert "-------------------------  step = 0  ----------------------" in text
    assert "Tensor <shape=torch.Size([4, 8]), dtype=torch.float32, device=xla:0, size=32, >" in text


def test_correct_kernels_pass_on_xla_forward_and_backward(xla, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = _model(xla)
    with open_module_tracker(model), CompareWithCPU(verbose=True) as cmp:
        model(_x(xla)).sum().backward()
    assert cmp.failures == [] and cmp.skipped == []
    assert cmp.stats["passed"] >= 10
    assert "(backward) succeeds to pass CompareWithCPU test" in caplog.text


# ------------------------------------------ (2) white_list / target_list ---
def test_white_list_excludes_the_op(xla, wrong_xla_addmm, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = _model(xla)
    with open_module_tracker(model), torch.no_grad():
        with CompareWithCPU(white_list=["torch.ops.aten.addmm"], verbose=True) as cmp:
            model(_x(xla))
    assert cmp.failures == []
    assert "DecoderLayer/Attention/Linear/torch.ops.aten.addmm(forward) is in white_list, pass" in caplog.text
    assert cmp.stats["passed"] > 0


@pytest.mark.parametrize("kw", [{"target_list": ["aten.add"]}, {"target_op": ["torch.ops.aten.add"]}])
def test_target_list_restricts_to_named_ops(xla, wrong_xla_addmm, kw, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = _model(xla)
    with open_module_tracker(model), torch.no_grad(), CompareWithCPU(verbose=True, **kw) as cmp:
        model(_x(xla))
    assert cmp.failures == []  # the wrong addmm is not a target
    assert cmp.stats["checked"] == cmp.stats["passed"] == 2  # the two aten.add ops
    assert "torch.ops.aten.addmm(forward) is not in target_list, pass" in caplog.text


def test_target_op_overload_name_finds_the_planted_op(xla, wrong_xla_addmm):
    model = _model(xla)
    with open_module_tracker(model), torch.no_grad():
        with CompareWithCPU(target_op=["torch.ops.aten.addmm.default"]) as cmp:
            model(_x(xla))
    assert cmp.stats["checked"] == 2
    assert [f.op_name for f in cmp.failures] == ["torch.ops.aten.addmm"] * 2


def test_op_name_spellings():
    addmm = torch.ops.aten.addmm.default
    for entry in [
        "torch.ops.aten.addmm",
        "aten.addmm",
        "aten::addmm",
        "addmm",
        "torch.ops.aten.addmm.default",
        "aten::addmm.default",
        "aten.add*",
        torch.ops.aten.addmm,
        torch.ops.aten.addmm.default,
    ]:
        assert addmm in OpMatcher([entry]), entry
    for entry in ["aten.add", "torch.ops.aten.addmm.out", "aten.mm", torch.ops.aten.addmm.out]:
        assert addmm not in OpMatcher([entry]), entry
    assert torch.ops.aten.div_.Tensor in OpMatcher([torch.ops.aten.div_.Tensor])
    assert resolve_op("torch.ops.aten.addmm") is torch.ops.aten.addmm
    assert resolve_op("aten::addmm.default") is torch.ops.aten.addmm.default
    assert resolve_op("addmm") is torch.ops.aten.addmm
    assert torch.ops.aten.empty_strided.default in OpMatcher(DEFAULT_WHITE_LIST)
    assert torch.ops.aten.uniform_.default in OpMatcher(DEFAULT_WHITE_LIST)
    assert torch.ops.aten.mm.default not in OpMatcher(DEFAULT_WHITE_LIST)


# ------------------------------------------------------ (3) step window ---
def test_step_window(xla, wrong_xla_addmm):
    model = _model(xla)
    x = _x(xla)
    seen = []
    with open_module_tracker(model), torch.no_grad(), CompareWithCPU(start_step=1, end_step=2) as cmp:
        for _ in range(3):
            before = len(cmp.failures), cmp.stats["checked"]
            model(x)
            seen.append((len(cmp.failures) - before[0], cmp.stats["checked"] - before[1]))
            cmp.step()
    assert seen[0] == (0, 0)  # step 0 < start_step: nothing compared
    assert seen[1][0] == 2 and seen[1][1] > 2  # step 1: compared, both addmm fail
    assert seen[2] == (0, 0)  # step 2 == end_step: stopped
    assert {f.step for f in cmp.failures} == {1}
    assert cmp.step_cnt == 3


# ------------------------------------------------------ (4) NaN/Inf -------
def test_nan_inf_tracker_names_the_first_op_cpu(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    model = _model("cpu", shift=100.0)  # log(h - 100) is NaN everywhere
    with open_module_tracker(model), torch.no_grad(), NanInfTracker() as tracker:
        model(_x("cpu"))
    first = tracker.first_nan_inf
    assert first is tracker.first_failure is not None
    assert first.op_name == "torch.ops.aten.log"
    assert first.module_path == "DecoderLayer/MLP"
    assert first.nan_count == 32 and first.inf_count == 0 and first.first_bad_index == (0, 0)
    # later ops (mul, add in DecoderLayer) propagate the NaN and come after it
    assert [f.op_name for f in tracker.failures][:3] == [
        "torch.ops.aten.log",
        "torch.ops.aten.mul",
        "torch.ops.aten.add",
    ]
    lines = [r.getMessage() for r in caplog.records if "[WARNING]" in r.getMessage()]
    assert lines[0].startswith("[WARNING] DecoderLayer/MLP/torch.ops.aten.log(forward) has nan/inf")


def test_nan_inf_tracker_deferred_on_xla(xla):
    model = _model(xla, shift=100.0)
    with open_module_tracker(model), torch.no_grad():
        with NanInfTracker() as tracker:
            y = model(_x(xla))
            assert tracker.failures == []  # deferred: nothing resolved yet, no per-op sync
            assert tracker.check().op_name == "torch.ops.aten.log"  # resolve now
            y * 3.0
        # the rest is resolved at exit, order kept, ops named with their module path
        assert tracker.failures[-1].op_name == "torch.ops.aten.mul" and tracker.failures[-1].module_path == ""
    assert tracker.first_failure.op_name == "torch.ops.aten.log"
    assert tracker.first_failure.module_path == "DecoderLayer/MLP"
    assert tracker.first_failure.device == "xla:0"
    assert torch.isnan(y.cpu()).all()


def test_nan_inf_tracker_deferred_on_cpu_keeps_order():
    model = _model("cpu", shift=100.0)
    with open_module_tracker(model), torch.no_grad(), NanInfTracker(deferred=True, flush_every=3) as tracker:
        model(_x("cpu"))
    assert tracker.first_failure.op_name == "torch.ops.aten.log"
    assert tracker.first_failure.module_path == "DecoderLayer/MLP"
    assert [f.op_index for f in tracker.failures] == sorted(f.op_index for f in tracker.failures)


def test_nan_inf_tracker_no_false_positive_on_overflowing_sum():
    big = torch.full((64, 64), torch.finfo(torch.float32).max / 2)
    with NanInfTracker() as tracker:
        z = big * 1.5  # finite values whose sum overflows
        w = torch.where(z > 0, z, z)
    assert torch.isfinite(w).all()
    assert tracker.failures == []
    with NanInfTracker() as tracker:
        (big * 4.0).sum()  # a real inf
    assert tracker.first_failure.op_name == "torch.ops.aten.mul"
    assert tracker.first_failure.inf_count == 64 * 64


def test_nan_inf_tracker_checks_dtype_conversions():
    """fp32 -> fp16 overflow (the AMP NaN/Inf source) is caught on the copy op,
    although copies are in CompareWithCPU's default white list."""
    x = torch.full((3,), 1e6)
    with NanInfTracker() as tracker:
        y = x.half()
    assert torch.isinf(y).all()
    assert tracker.first_failure.op_name == "torch.ops.aten._to_copy"
    with CompareWithCPU(verbose=True) as cmp:
        x.half()
    assert cmp.stats["white_listed"] == 1 and cmp.stats["checked"] == 0


def test_nan_inf_in_place_and_integer_outputs():
    x = torch.ones(5)
    with NanInfTracker() as tracker:
        x.div_(0.0)  # in-place: the mutated tensor is checked
        torch.arange(5).argmax()  # integer output: never NaN
    assert tracker.first_failure.op_name == "torch.ops.aten.div_"
    assert tracker.first_failure.inf_count == 5


# ------------------------------------------------ (5) dump + replay -------
def test_dump_error_data_and_compare_for_single_op(xla, wrong_xla_addmm, tmp_path):
    model = _model(xla)
    with (
        open_module_tracker(model),
        torch.no_grad(),
        pytest.raises(CompareError) as ei,
        CompareWithCPU(
            atol=1e-3, rtol=1e-3, target_op=["torch.ops.aten.addmm"], dump_error_data=True, output_dir=str(tmp_path)
        ),
    ):
        model(_x(xla))
    rec = ei.value.record
    assert isinstance(ei.value, RuntimeError)
    assert rec.module_path == "DecoderLayer/Attention/Linear"
    inputs = tmp_path / "torch.ops.aten.addmm_inputs.safetensors"
    outputs = tmp_path / "torch.ops.aten.addmm_outputs.safetensors"
    assert rec.dump_path == str(inputs) and inputs.exists() and outputs.exists()
    values, info = load_op_dump(str(inputs))
    assert info["op"] == "aten::addmm.default" and info["device"] == "xla:0"
    assert info["module_path"] == "DecoderLayer/Attention/Linear"
    assert [tuple(t.shape) for t in values["args"]] == [(8,), (4, 8), (8, 8)]
    outs, _ = load_op_dump(str(outputs))
    assert torch.allclose(outs["out"], outs["cpu_out"] * 1.01, atol=1e-5)

    # the wrong kernel is still registered: the replay on xla reproduces the failure
    correct, args, _kwargs, out = compare_for_single_op(str(inputs), torch.ops.aten.addmm, atol=1e-3, rtol=1e-3)
    assert correct is False and out.device.type == "xla" and args[0].device.type == "xla"
    # the name spelling of the seed's docs works too, and the op can come from the dump
    assert compare_for_single_op(str(inputs), "torch.ops.aten.addmm", 1e-3, 1e-3)[0] is False
    assert compare_for_single_op(str(inputs))[0] is False
    # the seed's docs name the file ..._inputs.pkl: that name finds the safetensors dump
    assert compare_for_single_op(str(tmp_path / "torch.ops.aten.addmm_inputs.pkl"))[0] is False
    # replayed on the CPU only, there is nothing to find
    assert compare_for_single_op(str(inputs), device="cpu")[0] is True


def test_replay_passes_once_the_kernel_is_fixed(xla, tmp_path):
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.impl(
            "addmm",
            lambda b, m1, m2, *, beta=1, alpha=1: (torch.ops.aten.mm.default(m1, m2) * alpha + b * beta) * 1.01,
            "XLA",
        )
    try:
        with pytest.raises(CompareError):
            with torch.no_grad(), CompareWithCPU(dump_error_data=True, output_dir=str(tmp_path)):
                nn.Linear(8, 8).to(xla)(_x(xla))
        path = str(tmp_path / "torch.ops.aten.addmm_inputs.safetensors")
        assert compare_for_single_op(path, torch.ops.aten.addmm)[0] is False
    finally:
        _destroy(lib)
    assert compare_for_single_op(path, torch.ops.aten.addmm)[0] is True


def test_nan_inf_dump_and_single_op(tmp_path):
    model = _model("cpu", shift=100.0)
    with open_module_tracker(model), torch.no_grad(), pytest.raises(NanInfError) as ei:
        with NanInfTracker(dump_error_data=True, output_dir=str(tmp_path)):
            model(_x("cpu"))
    assert ei.value.record.op_name == "torch.ops.aten.log"
    path = tmp_path / "torch.ops.aten.log_inputs.safetensors"
    assert path.exists()
    correct, args, _kwargs, out = nan_inf_track_for_single_op(str(path), torch.ops.aten.log)
    assert correct is False and torch.isnan(out).all()
    # the input itself was finite: the log made the NaN
    assert torch.isfinite(args[0]).all()


def test_in_place_dump_keeps_the_pre_op_inputs(tmp_path):
    x = torch.ones(4)
    with pytest.raises(NanInfError), NanInfTracker(dump_error_data=True, output_dir=str(tmp_path)):
        x.div_(0.0)
    assert torch.isinf(x).all()
    values, info = load_op_dump(str(tmp_path / "torch.ops.aten.div__inputs.safetensors"))
    assert info["op"] == "aten::div_.Tensor"  # the Python scalar arrives as a 0-dim tensor
    assert values["args"][0].tolist() == [1.0] * 4 and float(values["args"][1]) == 0.0
    outs, _ = load_op_dump(str(tmp_path / "torch.ops.aten.div__outputs.safetensors"))
    assert torch.isinf(outs["out"]).all()
    assert nan_inf_track_for_single_op(str(tmp_path / "torch.ops.aten.div__inputs.safetensors"))[0] is False


def test_dump_round_trip_of_argument_kinds(tmp_path):
    from pytest_layerparity.ops import save_op_dump

    t = torch.randn(2, 3)
    c = torch.randn(2, dtype=torch.complex64)
    values = {
        "args": [
            t,
            [t, None],
            3,
            2.5,
            float("nan"),
            True,
            "mean",
            torch.bfloat16,
            torch.device("cpu"),
            (1, 2),
            c,
            torch.arange(3),
        ],
        "kwargs": {"dim": -1, "memory_format": torch.contiguous_format},
    }
    path = save_op_dump(str(tmp_path / "x.safetensors"), values, {"op": "aten::add.Tensor"})
    back, info = load_op_dump(path)
    a = back["args"]
    assert torch.equal(a[0], t) and a[1][0] is a[0] and a[1][1] is None
    assert a[2:4] == [3, 2.5] and a[4] != a[4] and a[5] is True and a[6] == "mean"
    assert a[7] is torch.bfloat16 and a[8] == torch.device("cpu") and a[9] == (1, 2)
    assert torch.equal(a[10], c) and a[11].dtype == torch.int64
    assert back["kwargs"] == {"dim": -1, "memory_format": torch.contiguous_format}
    assert info["op"] == "aten::add.Tensor"
    with pytest.raises(DumpFormatError, match="could not be saved"):
        save_op_dump(str(tmp_path / "y.safetensors"), {"args": [object()]}, {})
        load_op_dump(str(tmp_path / "y.safetensors"))


# ------------------------------------------------ (6) safe loading --------
class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_dump_files_cannot_execute_code(tmp_path, xla, wrong_xla_addmm):
    # a genuine dump is a safetensors file (no pickle involved)
    with pytest.raises(CompareError):
        with torch.no_grad(), CompareWithCPU(dump_error_data=True, output_dir=str(tmp_path)):
            nn.Linear(8, 8).to(xla)(_x(xla))
    good = tmp_path / "torch.ops.aten.addmm_inputs.safetensors"
    from safetensors.torch import load_file

    assert set(load_file(str(good))) == {"t0", "t1", "t2"}
    assert compare_for_single_op(str(good))[0] is False

    # a crafted pickle placed at the dump's path is refused, and its payload never runs
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Payload(str(marker)))
    for name in ("torch.ops.aten.addmm_inputs.safetensors", "torch.ops.aten.addmm_inputs.pkl"):
        (tmp_path / name).write_bytes(evil)
        with pytest.raises(DumpFormatError, match="pickle files are never loaded"):
            compare_for_single_op(str(tmp_path / name), torch.ops.aten.addmm)
        with pytest.raises(DumpFormatError):
            nan_inf_track_for_single_op(str(tmp_path / name), torch.ops.aten.addmm)
    assert not marker.exists()
    # sanity: the payload is real (unpickling it would have created the file)
    pickle.loads(evil).close()
    assert marker.exists()


# ------------------------------------------------ (7) Half/BF16 upcast ----
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_bf16_without_cpu_kernel_is_upcast(xla, dtype, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    x = _x(xla).to(dtype)
    with CompareWithCPU(atol=1e-2, rtol=1e-2, verbose=True) as cmp:
        torch.trace(x)  # the CPU has no Half/BF16 kernel for trace
    assert cmp.failures == [] and cmp.skipped == [] and cmp.stats["passed"] == 1
    name = "Half" if dtype == torch.float16 else "BFloat16"
    assert f"\"trace\" not implemented for '{name}'" in caplog.text
    assert "Convert to float32 ..." in caplog.text
    assert "torch.ops.aten.trace(forward) succeeds to pass CompareWithCPU test" in caplog.text


def test_upcast_comparison_still_catches_a_wrong_kernel(xla):
    """A wrong XLA trace kernel (+1) on BF16 input: the CPU reference is
    computed in float32 (no BF16 trace on the CPU) and the error is still found."""
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.impl("trace", lambda t: torch.ops.aten.diagonal.default(t).sum() + 1.0, "XLA")
    try:
        x = _x(xla, shape=(4, 4)).to(torch.bfloat16)
        with CompareWithCPU(atol=1e-2, rtol=1e-2) as cmp:
            torch.trace(x)
    finally:
        _destroy(lib)
    (rec,) = cmp.failures
    assert rec.op_name == "torch.ops.aten.trace" and rec.cpu_upcast is True
    assert 0.9 < rec.max_abs_diff < 1.1
    assert "Convert to float32 ..." in rec.message  # the note heads the failure block
    assert "dtype=torch.float32, device=cpu" in rec.message


# ------------------------------------------- (8) files and ranks ----------
def test_should_log_to_file_per_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    model = _model("cpu")
    with open_module_tracker(model):
        with CompareWithCPU(verbose=True, should_log_to_file=True, output_dir=str(tmp_path)) as cmp:
            model(_x("cpu"))
        with NanInfTracker(should_log_to_file=True, output_dir=str(tmp_path)):
            model(_x("cpu"))
    log = tmp_path / "compare_with_cpu_rank3.log"
    assert cmp.rank == 3 and log.exists()
    text = log.read_text()
    assert "-------------------------  step = 0  ----------------------" in text
    assert "DecoderLayer/Attention/Linear/torch.ops.aten.addmm(forward) succeeds to pass CompareWithCPU test" in text
    assert (tmp_path / "nan_inf_tracker_rank3.log").exists()


def test_enable_ranks_excluding_this_rank_disables(tmp_path, monkeypatch, xla, wrong_xla_addmm):
    monkeypatch.setenv("RANK", "1")
    with torch.no_grad(), CompareWithCPU(enable_ranks=[0], should_log_to_file=True, output_dir=str(tmp_path)) as cmp:
        assert torch._C._len_torch_dispatch_stack() == 0
        nn.Linear(8, 8).to(xla)(_x(xla))
    assert cmp.failures == [] and cmp.stats["checked"] == 0
    assert not any(tmp_path.iterdir())
    monkeypatch.setenv("RANK", "0")
    with torch.no_grad(), CompareWithCPU(enable_ranks=[0]) as cmp:
        nn.Linear(8, 8).to(xla)(_x(xla))
    assert len(cmp.failures) == 1


# ------------------------------------------------- (9) enabled=False ------
def test_enabled_false_does_nothing(xla, wrong_xla_addmm, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    for tool in (CompareWithCPU(enabled=False, verbose=True), NanInfTracker(enabled=False)):
        with torch.no_grad(), tool as t:
            assert t is tool
            assert torch._C._len_torch_dispatch_stack() == 0
            nn.Linear(8, 8).to(xla)(_x(xla))
            torch.log(-torch.ones(2))
            t.step()
        assert t.failures == [] and t.stats["checked"] == 0
    assert [r for r in caplog.records if r.name.startswith(LOGGER)] == []


# ------------------------------------------------- dispatch subtleties ----
def test_in_place_ops_are_applied_once_and_compared(xla):
    for dev in ("cpu", xla):
        x = torch.arange(6, dtype=torch.float32).to(dev)
        y = torch.zeros(6).to(dev)
        with CompareWithCPU() as cmp:
            x.add_(1.0)
            torch.mul(x, 2.0, out=y)
            x.mul_(3.0)
        assert x.cpu().tolist() == [3.0, 6.0, 9.0, 12.0, 15.0, 18.0], dev
        assert y.cpu().tolist() == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0], dev
        assert cmp.failures == [] and cmp.skipped == [] and cmp.stats["passed"] >= 2


def test_tuple_integer_and_factory_outputs(xla):
    x = _x(xla)
    with CompareWithCPU(verbose=True) as cmp:
        _values, idx = torch.max(x, dim=1)  # tuple output, int64 indices compared exactly
        ones = torch.ones(3, 2, device=xla)  # factory op: device kwarg mapped to cpu
        s = torch.ops.aten.sym_size.int(x, 0)  # non-tensor output
        ln = torch.nn.functional.layer_norm(x, (8,))  # native_layer_norm: 3 outputs
    assert cmp.failures == [] and cmp.skipped == []
    assert cmp.stats["passed"] >= 3
    assert s == 4 and ones.device.type == "xla" and idx.dtype == torch.int64 and ln.shape == x.shape


def test_op_the_cpu_cannot_run_is_logged_not_fatal(xla, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    lib = torch.library.Library("lp_ops_test", "DEF")
    try:
        lib.define("xla_only(Tensor x) -> Tensor")
        lib.impl("xla_only", lambda x: x * 2, "XLA")  # no CPU kernel
        with CompareWithCPU() as cmp:
            y = torch.ops.lp_ops_test.xla_only(_x(xla))
        assert torch.allclose(y.cpu(), _x("cpu") * 2)
        assert cmp.failures == [] and len(cmp.skipped) == 1
        assert "torch.ops.lp_ops_test.xla_only(forward) cannot run on cpu, skip comparing" in caplog.text
    finally:
        _destroy(lib)


def test_mode_is_not_reentered_by_its_own_cpu_run():
    seen = []

    class Spy(CompareWithCPU):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return super().__torch_dispatch__(func, types, args, kwargs)

    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with Spy() as cmp:
        torch.mm(a, b).relu()
    # the mode saw the user's two ops only, not the CPU copies/re-runs/compares it made
    assert seen == ["aten.mm.default", "aten.relu.default"]
    assert cmp.stats["passed"] == 2


def test_module_tracker_paths_forward_and_backward():
    records = []

    class Rec(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            records.append((ModuleInfo.current_path(), str(func.overloadpacket), phase))
            return func(*args, **(kwargs or {}))

    model = _model("cpu")
    handle = open_module_tracker(model)
    assert open_module_tracker(model) is handle
    x = _x("cpu").requires_grad_()
    with Rec():
        model(x).sum().backward()
    fw = {(p, op) for p, op, ph in records if ph == "forward"}
    bw = {(p, op) for p, op, ph in records if ph == "backward"}
    assert ("DecoderLayer/Attention/Linear", "aten.addmm") in fw
    assert ("DecoderLayer/Attention", "aten._softmax") in fw
    assert ("DecoderLayer/MLP/Linear", "aten.addmm") in fw
    assert ("DecoderLayer/Attention/Linear", "aten.mm") in bw
    assert ("DecoderLayer/Attention", "aten._softmax_backward_data") in bw
    assert ModuleInfo.current_path() == ""
    handle.remove()
    records.clear()
    with Rec():
        model(x)
    assert {p for p, _, _ in records} == {""}


class _Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, c):
        return torch.sigmoid(self.lin(c))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = _Gate()
        self.attn = Attention()
        self.out = nn.Linear(8, 8)

    def forward(self, *, hidden_states):
        g = self.gate(torch.ones(4, 8))  # its input needs no grad: no "backward done" hook fires
        return self.out(self.attn(hidden_states) * g)


def test_module_tracker_backward_with_kwargs_and_constant_inputs():
    records = []

    class Rec(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if torch._C._current_graph_task_id() != -1:
                records.append((ModuleInfo.current_path(), str(func.overloadpacket)))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(4, 8, requires_grad=True)
    with open_module_tracker(block), Rec():
        block(hidden_states=x).sum().backward()
    paths = {p for p, _ in records}
    assert ("_Block/Attention/Linear", "aten.mm") in records
    assert ("_Block/_Gate/Linear", "aten.mm") in records
    assert ("_Block/Linear", "aten.mm") in records
    assert all("_Gate/Attention" not in p and "Attention/_Gate" not in p for p in paths), paths


def test_module_stack_survives_an_exception():
    class Boom(nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    outer = nn.Sequential(nn.Linear(2, 2), Boom())
    with open_module_tracker(outer):
        with pytest.raises(ValueError):
            outer(torch.randn(1, 2))
        assert ModuleInfo.current_stack() == []


def test_llama_decoder_layer_cpu_runs_clean():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        max_position_embeddings=64,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, 0).eval()
    x = torch.randn(1, 16, 64)
    pos = torch.arange(16)[None]
    pe = LlamaRotaryEmbedding(cfg)(x, pos)
    mask = torch.full((16, 16), torch.finfo(torch.float32).min).triu(1)[None, None]
    with open_module_tracker(layer), torch.no_grad(), CompareWithCPU() as cmp, NanInfTracker() as nan:
        layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
    assert cmp.failures == [] and cmp.skipped == [] and cmp.stats["passed"] > 10
    assert nan.failures == [] and nan.stats["checked"] > 10
