"""Text of failures and the session summary, and the machine-readable report."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any



def _value(value: float) -> str:
    return f"{value:.6g}"


def failure_text(outcome: Any, where: str, drill: str) -> str:
    """What a failing layer says: the layer, each metric against its threshold, shape and
    dtype, the worst element, and the next command to run."""
    m = outcome.metrics
    lines = [
        f"layer {outcome.layer} {where}: output differs from the golden",
        f"  shape {outcome.shape}, golden {outcome.golden_dtype}, target {outcome.target_dtype}",
        f"  {'metric':<22} {'value':>14}   threshold",
    ]
    lines += [f"  {check.describe()}" for check in outcome.checks]
    lines.append(
        f"  worst element: index {tuple(m.worst_index)}: golden {_value(m.worst_golden)}, target {_value(m.worst_target)}"
    )
    if m.has_nan_or_inf:
        lines.append(
            f"  non-finite values: golden NaN {m.golden_nan} Inf {m.golden_inf}, target NaN {m.target_nan} Inf {m.target_inf}"
        )
    lines.append(f"  drill in: {drill}")
    return "\n".join(lines)


def properties(outcome: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(name, value) pairs for record_property / JUnit XML."""
    from .metrics import METRIC_NAMES

    m = outcome.metrics
    out = [(f"{prefix}{name}", getattr(m, name)) for name in METRIC_NAMES]
    out += [
        (f"{prefix}nan_count", m.golden_nan + m.target_nan),
        (f"{prefix}inf_count", m.golden_inf + m.target_inf),
        (f"{prefix}has_nan", bool(m.golden_nan or m.target_nan)),
        (f"{prefix}has_inf", bool(m.golden_inf or m.target_inf)),
        (f"{prefix}worst_index", list(m.worst_index)),
        (f"{prefix}worst_golden", m.worst_golden),
        (f"{prefix}worst_target", m.worst_target),
    ]
    return out


def write_report_json(folder: str | Path, entries: list[dict[str, Any]]) -> Path:
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    target = path / "report.json"
    target.write_text(json.dumps({"tests": entries}, indent=2, default=str) + "\n", encoding="utf-8")
    return target


def summary_lines(entries: list[dict[str, Any]]) -> list[str]:
    """One row per test: the layers, the verdict and the main metrics; the first failing layer."""
    if not entries:
        return []
    header = f"{'test':<40} {'verdict':<8} {'max_abs_diff':>13} {'mean_abs_diff':>14} {'cosine':>12} {'pearson':>12} {'similar%':>9}"
    lines = [header]
    first_fail = None
    for entry in entries:
        metrics = entry.get("metrics") or {}
        name = entry["nodeid"].split("::")[-1]
        cells = [metrics.get(k) for k in ("max_abs_diff", "mean_abs_diff", "cosine_similarity", "pearson_correlation", "similarity_percentage")]
        text = [f"{c:.4g}" if isinstance(c, (int, float)) else "-" for c in cells]
        lines.append(f"{name:<40} {entry['verdict']:<8} {text[0]:>13} {text[1]:>14} {text[2]:>12} {text[3]:>12} {text[4]:>9}")
        if entry["verdict"] == "fail" and first_fail is None:
            first_fail = entry
    if first_fail is not None:
        lines.append(f"first failing: {first_fail['nodeid'].split('::')[-1]} (layers {first_fail['layers']})")
    return lines
