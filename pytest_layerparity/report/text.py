"""What a person reads: the text of a failing test, and the session summary table."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .fields import SUMMARY_COLUMNS

if TYPE_CHECKING:
    from ..compare.judge import LayerOutcome
    from .entry import ReportEntry


def _value(value: float) -> str:
    return f"{value:.6g}"


#: The checks of what a call wrote to its KV cache (a decode step's appended keys and values,
#: a prompt's), apart from its output's.
CACHE_CHECKS = ("new_", "kv_", "prompt_")


def failure_text(outcome: LayerOutcome, where: str, next_command: str) -> str:
    """What a failing layer says: the layer, each metric against its threshold, shape and
    dtype, the worst element, and the next command to run."""
    m = outcome.metrics
    width = max([22] + [len(check.name) for check in outcome.checks])  # a branch_bias_<direction> may be longer
    failing = [check for check in outcome.checks if not check.ok]
    cache_only = failing and all(check.name.startswith(CACHE_CHECKS) for check in failing)
    what = "the keys and values it wrote to its KV cache differ from the golden's" if cache_only else None
    lines = [
        f"layer {outcome.layer} {where}: {what or 'output differs from the golden'}",
        f"  shape {outcome.shape}, golden {outcome.golden_dtype}, target {outcome.target_dtype}",
        f"  {'metric':<{width}} {'value':>14}   threshold",
    ]
    lines += [f"  {check.describe(width)}" for check in outcome.checks]
    lines.append(
        f"  worst element: index {tuple(m.worst_index)}: golden {_value(m.worst_golden)}, target "
        f"{_value(m.worst_target)}"
    )
    noise = outcome.floor
    if noise is not None:
        lines.append(
            f"  precision floor: ||golden - ref|| = {noise.golden_error:.4g}, ||target - ref|| = "
            f"{noise.target_error:.4g}; "
            + ("the ratios weigh each element's error by its size; " if noise.relative else "")
            + f"worst token {noise.worst_token} at {noise.token_noise_ratio:.3g}x its floor"
            + (
                f"; cosine of the layer's own contribution (output - input) {noise.delta_cosine:.6f}"
                if noise.delta_cosine is not None
                else ""
            )
        )
    if outcome.envelope is not None:
        lines.append(f"  {outcome.envelope.describe()}")
    if outcome.tainted_tokens:
        lines.append(
            f"  left out of the statistics against the floor (routing flipped on a near tie earlier in the chain): "
            f"tokens {outcome.tainted_tokens}"
        )
    if outcome.golden_flip_tokens:
        lines.append(
            "  left out of the statistics against the floor (the golden chose other experts there than its "
            f"higher-precision evaluation): tokens {outcome.golden_flip_tokens}"
        )
    for routing in outcome.routing:
        lines.append(f"  {routing.describe()}")
        if routing.flipped and noise is not None:
            lines.append(
                "  outputs differ on tokens that routed the same"
                if not outcome.passed
                else "  outputs agree on tokens that routed the same"
            )
            if routing.near_tie_flipped:
                lines.append(
                    f"  the verdict leaves the near-tie tokens {list(routing.near_tie_tokens)} out (--near-ties strict "
                    "counts them)"
                )
    if outcome.excluded_tokens:
        lines.append(
            f"  left out of the metrics (near-tie routing flips, --near-ties exclude): tokens {outcome.excluded_tokens}"
        )
    tol = outcome.tolerance
    if tol:
        needed = [f"atol {tol['atol']:.3g} (with rtol 0)", f"rtol {tol['rtol']:.3g} (with atol 0)"]
        if noise is not None:
            # the one limit holds the contribution and every branch, each from the golden's own bias
            distances = [abs(z) for z in (noise.contribution_z, *noise.branch_z.values()) if z is not None]
            needed.append(
                f"-o layerparity_max_noise_ratio={noise.noise_ratio:.3g} "
                f"-o layerparity_max_token_noise_ratio={noise.token_noise_ratio:.3g}"
                + (f" -o layerparity_max_contribution_z={max(distances):.3g}" if distances else "")
            )
        lines.append(f"  minimum passing tolerance: {'; '.join(needed)}")
    if m.has_nan_or_inf:
        lines.append(
            f"  non-finite values: golden NaN {m.golden_nan} Inf {m.golden_inf}, target NaN {m.target_nan} Inf "
            f"{m.target_inf}"
        )
    from ..compare.diagnosis import diagnose

    diagnosis = diagnose(outcome)
    if diagnosis is not None:
        lines.append(f"  {diagnosis.describe()}")
    if outcome.sight is not None:
        lines.append(f"  detection: {outcome.sight.describe()}")
    lines.append(f"  drill in: {next_command}")
    return "\n".join(lines)


#: The order in which failing tests are considered for "first failing": a layer alone (its
#: prompt, then its decode steps), then chained ranges, then tests of no layer (the model).
_FIRST_FAILING_GROUPS = (("test_layer_parity", "test_layer_decode_parity"), ("test_chain_parity",))


def first_failing(entries: list[ReportEntry]) -> ReportEntry | None:
    """The failing (or erroring) test of the lowest layer, isolated tests before chains and
    the prompt before the decode steps; tests of no layer (the whole model) last."""

    def order(entry: ReportEntry) -> tuple[int, int, int]:
        name = entry.test_name.split("[")[0]
        group = next((g for g, names in enumerate(_FIRST_FAILING_GROUPS) if name in names), len(_FIRST_FAILING_GROUPS))
        rank = _FIRST_FAILING_GROUPS[group].index(name) if group < len(_FIRST_FAILING_GROUPS) else 0
        numbers = re.findall(r"\d+", str(entry.layers))
        return (group, int(numbers[0]) if numbers else 0, rank)

    failing = [e for e in entries if e.verdict in ("fail", "error")]
    return min(failing, key=order) if failing else None


def model_summary(metrics: Mapping[str, Any]) -> str | None:
    """One line of the whole-model test's reported metrics for the terminal summary."""
    if "kl_divergence" not in metrics:
        return None
    text = (
        f"top-1 agreement {metrics.get('top1_agreement', math.nan):.4g} "
        f"({metrics.get('near_tie_flips', 0)} near-tie flips, {metrics.get('greedy_flips_outside_ties', 0)} others), "
        f"KL median {metrics['kl_divergence']:.3g}"
    )
    if metrics.get("kl_divergence_limit") is not None:
        text += f" (limit {metrics['kl_divergence_limit']:.3g})"
    if metrics.get("generated"):
        text += f", greedy tokens before divergence {metrics.get('generated_matched')}/{metrics['generated']}"
    return text


def summary_lines(entries: list[ReportEntry]) -> list[str]:
    """One row per test: the layers, the verdict and the main metrics; the first failing layer."""
    if not entries:
        return []
    columns = SUMMARY_COLUMNS
    lines = [f"{'test':<38} {'verdict':<8} " + " ".join(f"{title:>{width}}" for title, _, width in columns)]
    for entry in entries:
        metrics = entry.metrics or {}
        name = entry.test_name
        cells = []
        for _, key, width in columns:
            value = metrics.get(key)
            cells.append(f"{value:>{width}.4g}" if isinstance(value, (int, float)) else f"{'-':>{width}}")
        lines.append(f"{name:<38} {entry.verdict:<8} " + " ".join(cells))
        model = model_summary(metrics)
        if model is not None:
            lines.append(f"  {model}")
        if entry.verdict == "pass" and metrics.get("detection_text"):
            lines.append(f"  {metrics['detection_text']}")
        if entry.verdict == "skipped" and entry.message:
            lines.append(f"  {entry.message}")
    first_fail = first_failing(entries)
    if first_fail is not None:
        lines.append(f"first failing: {first_fail.test_name} (layers {first_fail.layers})")
    return lines
