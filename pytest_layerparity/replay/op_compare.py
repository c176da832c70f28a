"""``--op-compare``: re-run a failing layer op by op under CompareWithCPU (the target device
against the CPU) with the module tracker, and say which op goes wrong first and where."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..options import Settings
    from .runner import TargetSide

# Per golden dtype (atol, rtol) of one op against its CPU re-run: torch.testing's defaults,
# loosened for accumulations that differ by reduction order.
OP_TOLERANCES = {"bfloat16": (1e-2, 1.6e-2), "float16": (1e-3, 1e-3), "float32": (1e-4, 1e-4)}


@dataclass
class OpFinding:
    label: str | None
    detail: str
    replay: str | None

    def text(self) -> str:
        lines = ["  op-compare (the layer re-run op by op against the CPU):", f"    {self.detail}"]
        if self.replay:
            lines.append(f"    replay: {self.replay}")
        return "\n".join(lines)


def replay_command(dump: str, op_name: str, atol: float, rtol: float) -> str:
    code = (
        f"from pytest_layerparity.ops import compare_for_single_op; "
        f"print(compare_for_single_op({dump!r}, {op_name!r}, atol={atol!r}, rtol={rtol!r})[0])"
    )
    return f"python -c {shlex.quote(code)}"


def op_compare_dir(settings: Settings, rootpath: Path) -> Path:
    """Where --op-compare dumps failing ops: layerparity_op_compare_dir, else layerparity-opcompare/."""
    return Path(settings.op_compare_dir) if settings.op_compare_dir else rootpath / "layerparity-opcompare"


def op_tolerances(dtype_name: str, atol: float | None, rtol: float | None) -> tuple[float, float]:
    """(atol, rtol) of one op: the options when given, else the golden dtype's defaults."""
    default_atol, default_rtol = OP_TOLERANCES.get(dtype_name, OP_TOLERANCES["float32"])
    return (default_atol if atol is None else atol), (default_rtol if rtol is None else rtol)


def op_compare(target: TargetSide, index: int, out_dir: Path) -> OpFinding:
    """Rebuild layer ``index`` on the target and run its golden call under CompareWithCPU,
    stopping at the first op that fails (its inputs and outputs dumped to ``out_dir``)."""
    from ..ops import CompareError, CompareWithCPU, open_module_tracker

    atol, rtol = op_tolerances(target.golden_dtype_name, target.settings.op_atol, target.settings.op_rtol)
    entry = target.load_golden(index)
    module = target.build(index)
    out_dir.mkdir(parents=True, exist_ok=True)
    tracker = open_module_tracker(module)
    tool = CompareWithCPU(atol=atol, rtol=rtol, dump_error_data=True, output_dir=str(out_dir))
    try:
        with tool:
            target.run(module, entry)
    except CompareError as exc:
        record = exc.record
        dump = record.dump_path
        detail = (
            f"first op that fails: {record.label}: {record.num_bad} of {record.numel} elements off "
            f"(max abs diff {record.max_abs_diff:.4g}, atol {atol:g}, rtol {rtol:g}), first at index "
            f"{record.first_bad_index}"
        )
        return OpFinding(record.label, detail, replay_command(dump, record.op_name, atol, rtol) if dump else None)
    finally:
        tracker.remove()
    stats = getattr(tool, "stats", None)
    return OpFinding(
        None,
        f"every op matches its CPU re-run within atol {atol:g}, rtol {rtol:g} ({stats}); "
        "the difference comes from how the port composes ops, not from one kernel",
        None,
    )
