"""The report files of ``--parity-report`` and ``python -m pytest_layerparity compare``:
report.json, report.csv and report.html (the table and a plot of each metric across layers,
self-contained)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from .entry import ReportEntry
from .fields import CSV_COLUMNS, PLOTTED

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def write_report_json(folder: str | Path, entries: list[ReportEntry]) -> Path:
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    target = path / "report.json"
    tests = [entry.to_json() for entry in entries]
    target.write_text(json.dumps({"tests": tests}, indent=2, default=str) + "\n", encoding="utf-8")
    return target


def write_report_csv(folder: str | Path, entries: list[ReportEntry]) -> Path:
    import csv

    path = Path(folder) / "report.csv"
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        for entry in entries:
            metrics = entry.metrics or {}
            writer.writerow(
                [getattr(entry, c) if c in ("nodeid", "layers", "verdict") else metrics.get(c, "") for c in CSV_COLUMNS]
            )
    return path


def isolated_layer(entry: ReportEntry) -> int | None:
    """The layer of an entry that covers one layer (its ``layers`` is ``"3"``), else None."""
    layers = str(entry.layers)
    return int(layers) if layers.isdigit() else None


#: Panels drawn as 1 - value on a log axis (they sit at 0.9999... otherwise).
COMPLEMENTED = ("cosine_similarity", "pearson_correlation")
#: Panels on a log axis.
LOGARITHMIC = ("max_abs_diff", "mean_abs_diff", *COMPLEMENTED)
#: Values that span more than this factor go on a log axis (on a linear one the largest flattens the rest).
DECADES = 100.0
#: The band each panel is held to: (lower field or None, upper field), when the entries carry them.
BANDS = {
    "noise_ratio": (None, "noise_ratio_limit"),
    "token_noise_ratio": (None, "token_noise_ratio_limit"),
    "contribution_bias": ("contribution_bias_low", "contribution_bias_high"),
}


def _test_name(entry: ReportEntry) -> str:
    return entry.test_name.split("[")[0]


def _per_layer_series(entries: list[ReportEntry], names: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    """field -> [(layer, value)] from the isolated layer tests (the prompt's; decode steps
    and ranges are other series)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for entry in entries:
        layer = isolated_layer(entry)
        if layer is None or _test_name(entry) not in ("", "test_layer_parity"):
            continue
        for metric in names:
            value = (entry.metrics or {}).get(metric)
            if isinstance(value, (int, float)):
                series.setdefault(metric, []).append((layer, float(value)))
    return {k: sorted(v) for k, v in series.items()}


def _chained_series(entries: list[ReportEntry], names: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    """field -> [(layer, value)] along the chained runs (each layer of a chain fed the
    previous layer's target output: the drift that accumulates), from their per-layer
    properties ``layer_N.<field>``."""
    series: dict[str, dict[int, float]] = {}
    for entry in entries:
        if _test_name(entry) != "test_chain_parity":
            continue
        for key, value in (entry.properties or {}).items():
            prefix, _, metric = key.partition(".")
            numeric = isinstance(value, (int, float))
            if numeric and metric in names and prefix.startswith("layer_") and prefix[6:].isdigit():
                series.setdefault(metric, {})[int(prefix[6:])] = float(value)
    return {k: sorted(v.items()) for k, v in series.items()}


class YScale(NamedTuple):
    """A panel's y axis: ``name`` as ``Axes.set_yscale`` takes it; ``linthresh``: symlog's
    linear range around 0."""

    name: str
    linthresh: float | None = None


def y_scale(values: Iterable[float], logarithmic: bool = False) -> YScale:
    """The y axis that shows all of ``values`` (a panel's points and its band).

    Positive values: ``log`` where the largest is over :data:`DECADES` times the smallest, or
    the panel is ``logarithmic``. With zeros or negative values: ``symlog`` where the largest
    magnitude is over :data:`DECADES` times the median nonzero one (an outlier), linear up to
    that median (to the smallest nonzero one on a ``logarithmic`` panel). Else linear.
    """
    finite = [v for v in values if math.isfinite(v)]
    sizes = sorted(abs(v) for v in finite if v != 0)
    if not sizes:
        return YScale("linear")
    if all(v > 0 for v in finite):
        return YScale("log") if logarithmic or sizes[-1] > DECADES * sizes[0] else YScale("linear")
    if logarithmic:
        return YScale("symlog", sizes[0])
    median = sizes[len(sizes) // 2]
    return YScale("symlog", median) if sizes[-1] > DECADES * median else YScale("linear")


@dataclass(frozen=True)
class Panel:
    """One panel of the plot across layers (what is drawn, as data)."""

    label: str
    points: list[tuple[int, float]]
    scale: YScale
    band: list[tuple[int, float, float]]  # (layer, low, high) of the noise envelope
    failing: list[tuple[int, float]]
    chained: list[tuple[int, float]] = field(default_factory=list)  # the same field along chained runs


def panels(entries: list[ReportEntry]) -> list[Panel]:
    """The panels of the plot: one per plotted metric the entries carry."""
    band_fields = tuple(f for pair in BANDS.values() for f in pair if f)
    series = _per_layer_series(entries, (*PLOTTED, *band_fields))
    chained = _chained_series(entries, PLOTTED)
    failed = {
        isolated_layer(e)
        for e in entries
        if e.verdict in ("fail", "error") and _test_name(e) in ("", "test_layer_parity")
    } - {None}
    out = []
    for name in (m for m in PLOTTED if m in series or m in chained):
        points = series.get(name, [])
        chain = chained.get(name, [])
        if name in COMPLEMENTED:
            points = [(x, max(1.0 - y, 1e-16)) for x, y in points]
            chain = [(x, max(1.0 - y, 1e-16)) for x, y in chain]
        low, high = BANDS.get(name, (None, None))
        band, bounds = [], []
        if high and high in series:
            lows = dict(series[low]) if low and low in series else {}
            band = [(x, lows.get(x, 0.0), y) for x, y in series[high]]
            bounds = [y for _, y in series[high]] + list(lows.values())  # a band without a low field starts at 0
        out.append(
            Panel(
                label=f"1 - {name}" if name in COMPLEMENTED else name,
                points=points,
                scale=y_scale([y for _, y in (*points, *chain)] + bounds, logarithmic=name in LOGARITHMIC),
                band=band,
                failing=[(x, y) for x, y in points if x in failed],
                chained=chain,
            )
        )
    return out


def plot_png(entries: list[ReportEntry]) -> bytes | None:
    """A PNG of :func:`panels` (see :func:`figure`), or None without matplotlib or data."""
    drawn = panels(entries)
    if not drawn:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    import io

    fig = figure(drawn)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return buffer.getvalue()


def figure(drawn: list[Panel]) -> Figure:
    """The panels drawn one above the other (failing layers marked, the envelope as a band,
    chained drift beside the isolated values, each on its :class:`YScale`, a tick per whole
    layer); close it with ``plt.close``."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(len(drawn), 1, figsize=(8, 2.2 * len(drawn)), sharex=True, squeeze=False)
    for ax, panel in zip(axes[:, 0], drawn, strict=False):
        if panel.points:
            ax.plot(*zip(*panel.points, strict=False), marker="o", color="#3465a4", label="isolated")
        if panel.chained:
            ax.plot(*zip(*panel.chained, strict=False), marker=".", linestyle="--", color="#f57900", label="chained")
        if panel.band:
            xs, lows, highs = zip(*panel.band, strict=False)
            ax.fill_between(xs, lows, highs, color="#8ae234", alpha=0.3, step="mid", label="noise envelope")
        if panel.failing:
            ax.scatter(*zip(*panel.failing, strict=False), color="#cc0000", zorder=3, label="fails")
        if panel.scale.name == "symlog":
            ax.set_yscale("symlog", linthresh=panel.scale.linthresh)
        elif panel.scale.name == "log":
            ax.set_yscale("log")
        ax.set_ylabel(panel.label, fontsize=8)
        ax.legend(loc="best", fontsize=7)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # layers are whole numbers
    axes[-1, 0].set_xlabel("decoder layer")
    fig.tight_layout()
    return fig


def plot_alt(drawn: list[Panel]) -> str:
    """The plot's alt text: its panels and the y axis of each."""
    return "metrics across layers; y axes: " + ", ".join(f"{p.label} ({p.scale.name})" for p in drawn)


def write_report_html(
    folder: str | Path,
    entries: list[ReportEntry],
    title: str = "layerparity report",
    header: list[str] | None = None,
) -> Path:
    """A self-contained page (the plot is embedded), readable offline."""
    import base64
    import html

    rows = []
    for entry in entries:
        metrics = entry.metrics or {}
        cells = "".join(f"<td>{html.escape(_cell(metrics.get(c)))}</td>" for c in CSV_COLUMNS[3:])
        cls = {"pass": "pass", "written": "pass", "skipped": "skip"}.get(entry.verdict, "fail")
        message = html.escape(entry.message or "")
        detail = (
            f"<tr class='detail'><td colspan='{len(CSV_COLUMNS)}'><pre>{message}</pre></td></tr>" if message else ""
        )
        rows.append(
            "<tr "
            f"class='{cls}'><td>{html.escape(entry.test_name)}</td><td>{html.escape(str(entry.layers))}</td>"
            f"<td>{html.escape(entry.verdict)}</td>{cells}</tr>{detail}"
        )
    from .text import first_failing

    first = first_failing(entries)
    summary = (
        f"<p class='bad'>First failing: {html.escape(first.test_name)} (layers {html.escape(str(first.layers))})</p>"
        if first
        else f"<p class='good'>All {len(entries)} tests pass.</p>"
    )
    png = plot_png(entries)
    plot = ""
    if png:
        alt = html.escape(plot_alt(panels(entries)))
        plot = f"<img alt='{alt}' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
    from .picture_svg import picture_html

    figures = "".join(picture_html(e.test_name, e.picture) for e in entries if e.picture and e.verdict != "pass")
    pictures = (
        "<h2>Failures against the golden's own rounding</h2>"
        "<p>Each failing test's error per element (beside the golden's rounding error), per token and per channel, "
        "in units of the golden's: an error confined to one token or channel stands out.</p>" + figures
        if figures
        else ""
    )
    head = "".join(f"<th>{html.escape(c)}</th>" for c in ("test", "layers", "verdict", *CSV_COLUMNS[3:]))
    lines = "".join(f"<li>{html.escape(line)}</li>" for line in header or [])
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; overflow-wrap: break-word; }}
/* the table scrolls in its box, the test ids staying at its left; the page never scrolls sideways */
.table-box {{ overflow-x: auto; max-width: 100%; container-type: inline-size; }}
table {{ border-collapse: separate; border-spacing: 0; font-size: 12px; border: solid #ccc;
  border-width: 1px 0 0 1px; }}
th, td {{ border: solid #ccc; border-width: 0 1px 1px 0; padding: 3px 6px; text-align: right; white-space: nowrap;
  background: #fff; }}
th {{ background: #eee; }} td:first-child {{ text-align: left; }}
tr:not(.detail) > :first-child {{ position: sticky; left: 0; z-index: 1; }}
tr.pass td:nth-child(3) {{ color: #2e7d32; font-weight: bold; }}
tr.fail td:nth-child(3) {{ color: #c62828; font-weight: bold; }}
tr.skip td:nth-child(3) {{ color: #6d6d6d; font-weight: bold; }}
tr.detail td {{ white-space: normal; }}
tr.detail pre {{ text-align: left; margin: 0; font-size: 11px; white-space: pre-wrap; overflow-wrap: anywhere;
  position: sticky; left: 6px; max-width: calc(100vw - 4em); max-width: calc(100cqw - 14px); }}
img {{ max-width: 100%; height: auto; }}
figure.failure-picture {{ margin: 1em 0; }} figure.failure-picture svg {{ max-width: 100%; height: auto;
  margin-right: 8px; }}
.bad {{ color: #c62828; font-weight: bold; }} .good {{ color: #2e7d32; font-weight: bold; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<ul>{lines}</ul>
{summary}
<div class='table-box'><table><tr>{head}</tr>{"".join(rows)}</table></div>
{pictures}
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


def write_reports(folder: str | Path, entries: list[ReportEntry], header: list[str] | None = None) -> list[Path]:
    return [
        write_report_json(folder, entries),
        write_report_csv(folder, entries),
        write_report_html(folder, entries, header=header),
    ]
