"""A failing test's :class:`~..compare.picture.FailurePicture` drawn for report.html, as inline
SVG (no plotting library): the error distribution of the target's elements beside the
golden's own rounding, and the error ratio per token and per channel on a log scale."""

from __future__ import annotations

import html
import math

from ..compare.picture import EDGES, FailurePicture

WIDTH, HEIGHT = 380, 200
LEFT, RIGHT, TOP, BOTTOM = 48, 10, 22, 34


def _x(fraction: float) -> float:
    return LEFT + fraction * (WIDTH - LEFT - RIGHT)


def _y(fraction: float) -> float:
    return HEIGHT - BOTTOM - fraction * (HEIGHT - TOP - BOTTOM)


def _frame(title: str, x_label: str, y_ticks: list[tuple[float, str]], x_ticks: list[tuple[float, str]]) -> list[str]:
    parts = [
        f"<text x='{WIDTH / 2}' y='14' text-anchor='middle' font-size='12'>{html.escape(title)}</text>",
        f"<rect x='{LEFT}' y='{TOP}' width='{WIDTH - LEFT - RIGHT}' height='{HEIGHT - TOP - BOTTOM}' "
        "fill='none' stroke='#999'/>",
        f"<text x='{_x(0.5)}' y='{HEIGHT - 4}' text-anchor='middle' font-size='10'>{html.escape(x_label)}</text>",
    ]
    for fraction, label in y_ticks:
        parts.append(f"<text x='{LEFT - 4}' y='{_y(fraction) + 3:.1f}' text-anchor='end' font-size='9'>{label}</text>")
    for fraction, label in x_ticks:
        parts.append(
            f"<text x='{_x(fraction):.1f}' y='{HEIGHT - BOTTOM + 12}' text-anchor='middle' font-size='9'>{label}</text>"
        )
    return parts


def _svg(name: str, parts: list[str], label: str) -> str:
    body = "".join(parts)
    return (
        f"<svg class='{name}' role='img' aria-label='{html.escape(label)}' width='{WIDTH}' height='{HEIGHT}' "
        f"viewBox='0 0 {WIDTH} {HEIGHT}' xmlns='http://www.w3.org/2000/svg'>{body}</svg>"
    )


def histogram(picture: FailurePicture) -> str:
    """The fraction of elements per error bin, the target's (red) over the golden's (grey)."""
    bins = len(EDGES) + 1
    top = max([*picture.target_bins, *picture.golden_bins, 1e-9])
    parts = _frame(
        "error per element / golden's rms rounding",
        "error (decades)",
        [(0.0, "0"), (1.0, f"{top:.2g}")],
        [((k + 1) / bins, f"1e{round(math.log10(EDGES[k]))}") for k in range(0, len(EDGES), 8)],
    )
    for values, color, name in ((picture.golden_bins, "#9e9e9e", "golden"), (picture.target_bins, "#c62828", "target")):
        points = " ".join(
            f"{_x(k / bins):.1f},{_y(v / top):.1f} {_x((k + 1) / bins):.1f},{_y(v / top):.1f}"
            for k, v in enumerate(values)
        )
        parts.append(f"<polyline class='{name}' points='{points}' fill='none' stroke='{color}' stroke-width='1.5'/>")
    parts.append(f"<text x='{_x(0.02)}' y='{TOP + 12}' font-size='9' fill='#9e9e9e'>golden</text>")
    parts.append(f"<text x='{_x(0.02)}' y='{TOP + 23}' font-size='9' fill='#c62828'>target</text>")
    return _svg("histogram", parts, "error distribution of the target's elements against the golden's rounding")


def profile(values: list[float], block: int, what: str, worst: int) -> str:
    """The error ratio per token or channel (log scale), the golden's own level (1) dashed."""
    low = min(0.1, *(v for v in values if v > 0)) if any(v > 0 for v in values) else 0.1
    high = max(10.0, *values)
    lo, hi = math.log10(low), math.log10(high)

    def fy(v: float) -> float:
        return (math.log10(max(v, low)) - lo) / (hi - lo)

    decades = range(math.ceil(lo), math.floor(hi) + 1)
    n = max(len(values), 1)
    parts = _frame(
        f"error ratio per {what} (largest at {what} {worst})",
        f"{what}" + (f" (blocks of {block})" if block > 1 else ""),
        [(fy(10.0**d), f"1e{d}") for d in decades],
        [(0.0, "0"), (1.0, str(n * block))],
    )
    parts.append(
        f"<line x1='{_x(0)}' x2='{_x(1)}' y1='{_y(fy(1.0)):.1f}' y2='{_y(fy(1.0)):.1f}' stroke='#9e9e9e' "
        "stroke-dasharray='4 3'/>"
    )
    width = (WIDTH - LEFT - RIGHT) / n
    for k, v in enumerate(values):
        height = _y(0) - _y(fy(v))
        parts.append(
            f"<rect x='{_x(k / n):.1f}' y='{_y(fy(v)):.1f}' width='{max(width - 0.5, 0.5):.1f}' "
            f"height='{max(height, 0.5):.1f}' fill='#c62828'/>"
        )
    return _svg(f"per-{what}", parts, f"error ratio per {what}")


def picture_html(test: str, text: str) -> str:
    """The figure of a failing test's picture (``text``: its JSON), or '' where it cannot be read."""
    try:
        picture = FailurePicture.from_json(text)
    except (TypeError, ValueError):
        return ""
    charts = (
        histogram(picture)
        + profile(picture.tokens, picture.token_block, "token", picture.worst_token)
        + profile(picture.channels, picture.channel_block, "channel", picture.worst_channel)
    )
    return (
        f"<figure class='failure-picture'><figcaption><b>{html.escape(test)}</b>: {html.escape(picture.caption())}"
        f"</figcaption>{charts}</figure>"
    )
