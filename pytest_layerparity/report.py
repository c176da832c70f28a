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
    noise = getattr(outcome, "noise", None)
    if noise is not None:
        lines.append(
            f"  precision floor: ||golden - ref|| = {noise.golden_error:.4g}, ||target - ref|| = {noise.target_error:.4g}; "
            f"worst token {noise.worst_token} at {noise.token_noise_ratio:.3g}x its floor"
            + (f"; cosine of the layer's own contribution (output - input) {noise.delta_cosine:.6f}" if noise.delta_cosine is not None else "")
        )
    for routing in getattr(outcome, "routing", []) or []:
        lines.append(f"  {routing.describe()}")
        if routing.flipped and noise is not None:
            lines.append("  outputs differ on tokens that routed the same" if not _passes(outcome)
                         else "  outputs agree on tokens that routed the same")
            if routing.near_tie_flipped:
                lines.append(f"  the verdict leaves the near-tie tokens {list(routing.near_tie_tokens)} out (--strict-routing counts them)")
    if getattr(outcome, "excluded_tokens", None):
        lines.append(f"  left out of the metrics (near-tie routing flips, --exclude-near-ties): tokens {outcome.excluded_tokens}")
    tol = getattr(outcome, "tolerance", None)
    if tol:
        needed = [f"atol {tol['atol']:.3g} (with rtol 0)", f"rtol {tol['rtol']:.3g} (with atol 0)"]
        if noise is not None:
            needed.append(f"--max-noise-ratio {noise.noise_ratio:.3g} --max-token-noise-ratio {noise.token_noise_ratio:.3g}"
                          + (f" --max-contribution-bias {abs(noise.contribution_z):.3g}" if noise.contribution_z is not None else ""))
        lines.append(f"  minimum passing tolerance: {'; '.join(needed)}")
    if m.has_nan_or_inf:
        lines.append(
            f"  non-finite values: golden NaN {m.golden_nan} Inf {m.golden_inf}, target NaN {m.target_nan} Inf {m.target_inf}"
        )
    lines.append(f"  drill in: {drill}")
    return "\n".join(lines)


# What properties() records besides the five metrics, under the same names in reports.
EXTRA_METRICS = ("noise_ratio", "token_noise_ratio", "contribution_bias", "delta_cosine", "routing_agreement",
                 "routing_flipped", "routing_near_tie_flipped", "nan_count", "inf_count", "worst_index",
                 "worst_golden", "worst_target")


def reported_metrics(props: dict[str, Any]) -> dict[str, Any]:
    """The metrics among a test's (unprefixed) properties, for report entries."""
    from .metrics import METRIC_NAMES

    return {k: props[k] for k in METRIC_NAMES + EXTRA_METRICS if k in props}


def _passes(outcome: Any) -> bool:
    return all(check.ok for check in outcome.checks)


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
    noise = getattr(outcome, "noise", None)
    if noise is not None:
        out += [(f"{prefix}noise_ratio", noise.noise_ratio), (f"{prefix}token_noise_ratio", noise.token_noise_ratio)]
        if noise.contribution_z is not None:
            out.append((f"{prefix}contribution_bias", abs(noise.contribution_z)))
        if noise.delta_cosine is not None:
            out.append((f"{prefix}delta_cosine", noise.delta_cosine))
    routings = getattr(outcome, "routing", None) or []
    if routings:
        tokens = sum(r.tokens for r in routings)
        same = sum(r.tokens - r.flipped for r in routings)
        out += [
            (f"{prefix}routing_agreement", same / tokens if tokens else 1.0),
            (f"{prefix}routing_flipped", sum(r.flipped for r in routings)),
            (f"{prefix}routing_near_tie_flipped", sum(r.near_tie_flipped for r in routings)),
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
    columns = [("max_abs_diff", "max_abs_diff", 12), ("mean_abs_diff", "mean_abs_diff", 13),
               ("cosine", "cosine_similarity", 10), ("pearson", "pearson_correlation", 10),
               ("similar%", "similarity_percentage", 9), ("noise_ratio", "noise_ratio", 11),
               ("token_ratio", "token_noise_ratio", 11), ("routing", "routing_agreement", 8)]
    lines = [f"{'test':<38} {'verdict':<8} " + " ".join(f"{title:>{width}}" for title, _, width in columns)]
    first_fail = None
    for entry in entries:
        metrics = entry.get("metrics") or {}
        name = entry["nodeid"].split("::")[-1]
        cells = []
        for _, key, width in columns:
            value = metrics.get(key)
            cells.append(f"{value:>{width}.4g}" if isinstance(value, (int, float)) else f"{'-':>{width}}")
        lines.append(f"{name:<38} {entry['verdict']:<8} " + " ".join(cells))
        if entry["verdict"] in ("fail", "error") and first_fail is None:
            first_fail = entry
    if first_fail is not None:
        lines.append(f"first failing: {first_fail['nodeid'].split('::')[-1]} (layers {first_fail['layers']})")
    return lines


CSV_COLUMNS = ("nodeid", "layers", "verdict", "max_abs_diff", "mean_abs_diff", "similarity_percentage",
               "cosine_similarity", "pearson_correlation", "noise_ratio", "token_noise_ratio", "contribution_bias",
               "routing_agreement", "routing_flipped", "routing_near_tie_flipped", "nan_count", "inf_count")
PLOTTED = ("max_abs_diff", "mean_abs_diff", "cosine_similarity", "pearson_correlation", "noise_ratio", "token_noise_ratio")


def write_report_csv(folder: str | Path, entries: list[dict[str, Any]]) -> Path:
    import csv

    path = Path(folder) / "report.csv"
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        for entry in entries:
            metrics = entry.get("metrics") or {}
            writer.writerow([entry.get(c, metrics.get(c, "")) if c in ("nodeid", "layers", "verdict") else metrics.get(c, "")
                             for c in CSV_COLUMNS])
    return path


def _per_layer_series(entries: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """metric -> [(layer, value)] from the isolated layer tests."""
    series: dict[str, list[tuple[int, float]]] = {}
    for entry in entries:
        layers = str(entry.get("layers", ""))
        if not layers.isdigit():
            continue
        for metric in PLOTTED:
            value = (entry.get("metrics") or {}).get(metric)
            if isinstance(value, (int, float)):
                series.setdefault(metric, []).append((int(layers), float(value)))
    return {k: sorted(v) for k, v in series.items()}


def plot_png(entries: list[dict[str, Any]]) -> bytes | None:
    """A PNG with one panel per metric across layers, or None without matplotlib or data."""
    series = _per_layer_series(entries)
    if not series:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    import io

    names = [m for m in PLOTTED if m in series]
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 2.2 * len(names)), sharex=True, squeeze=False)
    failed = {int(e["layers"]) for e in entries if str(e.get("layers", "")).isdigit() and e["verdict"] in ("fail", "error")}
    for ax, name in zip(axes[:, 0], names):
        xs, ys = zip(*series[name])
        ax.plot(xs, ys, marker="o", color="#3465a4")
        bad = [(x, y) for x, y in series[name] if x in failed]
        if bad:
            ax.scatter(*zip(*bad), color="#cc0000", zorder=3, label="fails")
            ax.legend(loc="best", fontsize=8)
        ax.set_ylabel(name, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("decoder layer")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return buffer.getvalue()


def write_report_html(folder: str | Path, entries: list[dict[str, Any]], title: str = "layerparity report",
                      header: list[str] | None = None) -> Path:
    """A self-contained page (the plot is embedded), readable offline."""
    import base64
    import html

    rows = []
    for entry in entries:
        metrics = entry.get("metrics") or {}
        cells = "".join(
            f"<td>{html.escape(_cell(metrics.get(c)))}</td>" for c in CSV_COLUMNS[3:]
        )
        cls = {"pass": "pass", "written": "pass"}.get(entry["verdict"], "fail")
        message = html.escape(entry.get("message") or "")
        detail = f"<tr class='detail'><td colspan='{len(CSV_COLUMNS)}'><pre>{message}</pre></td></tr>" if message else ""
        rows.append(f"<tr class='{cls}'><td>{html.escape(entry['nodeid'].split('::')[-1])}</td><td>{html.escape(str(entry['layers']))}</td>"
                    f"<td>{html.escape(entry['verdict'])}</td>{cells}</tr>{detail}")
    first = next((e for e in entries if e["verdict"] in ("fail", "error")), None)
    summary = (f"<p class='bad'>First failing: {html.escape(first['nodeid'].split('::')[-1])} (layers {html.escape(str(first['layers']))})</p>"
               if first else f"<p class='good'>All {len(entries)} tests pass.</p>")
    png = plot_png(entries)
    plot = f"<img alt='metrics across layers' src='data:image/png;base64,{base64.b64encode(png).decode()}'>" if png else ""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in ("test", "layers", "verdict") + CSV_COLUMNS[3:])
    lines = "".join(f"<li>{html.escape(line)}</li>" for line in header or [])
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; font-size: 12px; }}
th, td {{ border: 1px solid #ccc; padding: 3px 6px; text-align: right; }}
th {{ background: #eee; }} td:first-child {{ text-align: left; }}
tr.pass td:nth-child(3) {{ color: #2e7d32; font-weight: bold; }}
tr.fail td:nth-child(3) {{ color: #c62828; font-weight: bold; }}
tr.detail pre {{ text-align: left; margin: 0; font-size: 11px; white-space: pre-wrap; }}
.bad {{ color: #c62828; font-weight: bold; }} .good {{ color: #2e7d32; font-weight: bold; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<ul>{lines}</ul>
{summary}
<table><tr>{head}</tr>{''.join(rows)}</table>
<h2>Metrics across layers</h2>
{plot}
</body></html>
"""
    path = Path(folder) / "report.html"
    path.write_text(page, encoding="utf-8")
    return path


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def write_reports(folder: str | Path, entries: list[dict[str, Any]], header: list[str] | None = None) -> list[Path]:
    return [write_report_json(folder, entries), write_report_csv(folder, entries),
            write_report_html(folder, entries, header=header)]
