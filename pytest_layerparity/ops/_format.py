"""The tools' log text: tensors described by shape, dtype and device, and the block a
failing op is logged as (the format of torch_musa's compare tool)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ._compare import Mismatch

SEPARATOR = "============================"


def nan_inf_counts(t: torch.Tensor) -> tuple[int, int]:
    if not (t.is_floating_point() or t.is_complex()):
        return 0, 0
    return int(torch.isnan(t).sum()), int(torch.isinf(t).sum())


def describe_tensor(t: torch.Tensor, count_nan: bool = False) -> str:
    extra, head = "", ""
    if count_nan:
        n, i = nan_inf_counts(t)
        if n or i:
            head, extra = "[WARNING] ", f" nan_num={n}, inf_num={i},"
    return f"{head}Tensor <shape={t.shape}, dtype={t.dtype}, device={t.device}, size={t.numel()},{extra} >"


def describe_value(x: Any, count_nan: bool = False) -> str:
    if isinstance(x, torch.Tensor):
        return describe_tensor(x, count_nan)
    if isinstance(x, list):
        return "[" + ", ".join(describe_value(y, count_nan) for y in x) + "]"
    if isinstance(x, tuple):
        return "(" + ", ".join(describe_value(y, count_nan) for y in x) + ")"
    return repr(x)


def format_inputs(args: tuple, kwargs: dict) -> list[str]:
    lines = [f"{i}: {describe_value(a)}, " for i, a in enumerate(args)]
    lines += [f"{k}: {describe_value(v)}, " for k, v in kwargs.items()]
    return lines


def format_failure_block(
    label: str, tool: str, args: tuple, kwargs: dict, out: Any, mismatches: list[Mismatch], notes: Iterable[str] = ()
) -> str:
    lines = [
        *notes,
        "",
        SEPARATOR,
        f"[ERROR] {label} fails to pass {tool} test",
        "....... input .........",
        *format_inputs(args, kwargs),
        "",
        "",
        "...... output ........",
        describe_value(out, count_nan=True),
        "",
        "...... compare with cpu .......",
    ]
    for m in mismatches:
        lines += m.lines
        if m.reason == "values" and isinstance(m.device_value, torch.Tensor):
            lines += ["", "...", ""]
            lines += [describe_tensor(m.device_value), _tensor_str(m.device_value)]
            lines += [describe_tensor(m.cpu_value), _tensor_str(m.cpu_value)]
        lines.append("")
    lines.append(SEPARATOR)
    return "\n".join(lines)


def _tensor_str(t: torch.Tensor) -> str:
    try:
        return str(t)
    except Exception as e:
        return f"<cannot print tensor: {e}>"
