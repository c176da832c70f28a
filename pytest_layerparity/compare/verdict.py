"""Thresholds and the pass/fail verdict of one comparison.

Two policies:

* ``noise`` (the default): fail on NaN/Inf, on a cosine below the limit, or when the target's
  error against the precision floor (the layer evaluated in higher precision), in units of the
  golden's own rounding error, leaves what legitimate arithmetic does to this layer:
  tensor-wide (``noise_ratio``), on any one token (``token_noise_ratio``), along the layer's
  own contribution (``contribution_bias``) or along the output of one of its branches, its
  attention or its MLP (``branch_bias_<branch>``). The limits come from the golden's noise envelope
  (``compare.envelope``: perturbed runs of the layer, at a stated false-alarm rate); goldens
  with a floor but no envelope get the fixed limits below. Goldens without the floor get the
  ``table`` policy.
* ``table``: the seeds' fixed table (max/mean abs diff, similarity, cosine, Pearson).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..options import Settings
    from .envelope import EnvelopeLimits
    from .floor import FloorStats
    from .metrics import Metrics

# Per golden dtype: (max_noise_ratio, max_token_noise_ratio, min_cosine). Chosen from the
# measurements in bench/bench_verdicts.py (see bench/README.md, "Verdicts"):
# correct bf16 layers on torch-xla stayed below 1.1 (tensor-wide) and 1.6 (per token).
NOISE_DEFAULTS = {
    "bfloat16": (1.5, 3.0, 0.99),
    "float16": (1.5, 3.0, 0.99),
    "float32": (1.5, 3.0, 0.9999),
}
# The target's error along the layer's own contribution, in units of the noise: correct
# layers stayed within 4.6, bugs that scale a contribution (a norm epsilon, an expert
# scale) reach 10 and beyond.
MAX_CONTRIBUTION_Z = 6.0
#: How far a correct port may lie along a direction whose move is a bug's whole effect (GELU's
#: other form, ``floor.move.gelu_form``) beyond its rounding's range, as a share of that move, by
#: the golden's dtype: a GELU kernel leans that way by a share its inputs set, so each share is
#: 1.5 times the largest lean measured (``bench/bench_xla_kernels.py --gelu-forms``, bench/README.md).
KERNEL_LEAN = {"bfloat16": 4.9, "float16": 0.3}
DEFAULT_KERNEL_LEAN = 0.3


@dataclass(frozen=True)
class Check:
    """One metric against its threshold."""

    name: str
    value: float
    op: str  # "<=" (value must not exceed limit), ">=" (must reach limit), "==" for counts
    limit: float
    ok: bool
    low: float | None = None  # op "in": the value must lie in [low, limit]

    def describe(self, width: int = 22) -> str:
        """One row of a failure's table, the name in a column ``width`` wide."""
        verdict = "ok" if self.ok else "FAIL"
        if self.low is not None:
            bounds = f"[{_fmt(self.low)}, {_fmt(self.limit)}]"
            return f"{self.name:<{width}} {_fmt(self.value):>14}   in {bounds:<20} {verdict}"
        return f"{self.name:<{width}} {_fmt(self.value):>14}   {self.op} {_fmt(self.limit):<10} {verdict}"


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "nan"
    return f"{value:.6g}"


def _upper(name: str, value: float, limit: float) -> Check:
    return Check(name, value, "<=", limit, not math.isnan(value) and value <= limit)


def _lower(name: str, value: float, limit: float) -> Check:
    return Check(name, value, ">=", limit, not math.isnan(value) and value >= limit)


def _within(name: str, value: float, low: float, high: float) -> Check:
    return Check(name, value, "in", high, not math.isnan(value) and low <= value <= high, low=low)


def noise_limits(settings: Settings, dtype: str) -> tuple[float, float, float]:
    """(max_noise_ratio, max_token_noise_ratio, min_cosine) in force for ``dtype``."""
    ratio, token, cosine = NOISE_DEFAULTS.get(dtype, NOISE_DEFAULTS["bfloat16"])
    return (
        settings.max_noise_ratio if settings.max_noise_ratio is not None else ratio,
        settings.max_token_noise_ratio if settings.max_token_noise_ratio is not None else token,
        settings.min_cosine if settings.min_cosine is not None else cosine,
    )


def kernel_lean(floor: FloorStats, dtype: str) -> dict[str, float]:
    """Per direction whose move the golden stores: how far beyond its range a correct kernel
    may lean along it, in noise units (``KERNEL_LEAN``'s share of the move)."""
    share = KERNEL_LEAN.get(dtype, DEFAULT_KERNEL_LEAN)
    return {name: share * abs(move) for name, move in floor.branch_move.items()}


def policy_in_force(settings: Settings, has_floor: bool) -> str:
    return "noise" if settings.verdict == "noise" and has_floor else "table"


def contribution_limit(settings: Settings) -> float:
    return settings.max_contribution_z if settings.max_contribution_z is not None else MAX_CONTRIBUTION_Z


def evaluate(
    metrics: Metrics,
    settings: Settings,
    floor: FloorStats | None = None,
    dtype: str = "bfloat16",
    envelope: EnvelopeLimits | None = None,
    cosine: float | None = None,
) -> list[Check]:
    """Each metric against its threshold under the policy in force (the noise policy's
    limits from ``envelope`` when given; an explicit --max-* option still wins). ``cosine``:
    the noise policy's cosine when it is taken without the near-tie tokens."""
    non_finite = metrics.golden_nan + metrics.golden_inf + metrics.target_nan + metrics.target_inf
    checks = [Check("nan_inf_count", non_finite, "==", 0, non_finite == 0)]
    if policy_in_force(settings, floor is not None) == "noise":
        assert floor is not None
        max_ratio, max_token, min_cos = noise_limits(settings, dtype)
        if envelope is not None:
            if settings.max_noise_ratio is None:
                max_ratio = envelope.max_noise_ratio
            if settings.max_token_noise_ratio is None:
                max_token = envelope.max_token_noise_ratio
        checks += [
            _lower("cosine_similarity", metrics.cosine_similarity if cosine is None else cosine, min_cos),
            _upper("noise_ratio", floor.noise_ratio, max_ratio),
            _upper("token_noise_ratio", floor.token_noise_ratio, max_token),
        ]
        from_envelope = envelope is not None and settings.max_contribution_z is None
        fixed = contribution_limit(settings)  # else: within this many noise units of the golden's own bias
        bias = floor.contribution_bias
        if bias is not None:
            assert floor.golden_contribution_z is not None
            golden = floor.golden_contribution_z
            low, high = (envelope.bias_low, envelope.bias_high) if from_envelope else (golden - fixed, golden + fixed)
            checks.append(_within("contribution_bias", bias, low, high))
        lean = kernel_lean(floor, dtype)  # in an envelope's ranges already (Envelope.limits)
        for name, value in floor.branch_bias.items():  # the same along each branch's output
            if from_envelope and name not in envelope.branch_bias:
                continue
            golden, wider = floor.golden_branch_z[name], fixed + lean.get(name, 0.0)
            low, high = envelope.branch_bias[name] if from_envelope else (golden - wider, golden + wider)
            if name in floor.branch_move and golden + floor.branch_move[name] <= high:
                continue  # a port with the move's bug would pass: the check could only cry wolf
            checks.append(_within(f"branch_bias_{name}", value, low, high))
        return checks
    return [
        *checks,
        _upper("max_abs_diff", metrics.max_abs_diff, settings.max_abs_diff),
        _upper("mean_abs_diff", metrics.mean_abs_diff, settings.max_mean_abs_diff),
        _lower("similarity_percentage", metrics.similarity_percentage, settings.min_similarity),
        _lower("cosine_similarity", metrics.cosine_similarity, table_min_cosine(settings)),
        _lower("pearson_correlation", metrics.pearson_correlation, settings.min_pearson),
    ]


def table_min_cosine(settings: Settings) -> float:
    return settings.min_cosine if settings.min_cosine is not None else 0.99


def describe_rule(settings: Settings, dtype: str) -> str:
    """The rule in force, in one line (the session header prints it)."""
    if settings.verdict == "noise":
        ratio, token, cosine = noise_limits(settings, dtype)
        return (
            f"noise policy ({dtype}): fail on NaN/Inf, cosine_similarity < {cosine:g}, or noise_ratio, "
            "token_noise_ratio or contribution_bias (error against the float32/float64 evaluation, in units of "
            "the golden's own error) outside the layer's noise envelope at false-alarm rate "
            f"{settings.false_alarm_rate:g} per test; goldens without an envelope: noise_ratio > {ratio:g}, "
            f"token_noise_ratio > {token:g}, |contribution_bias - golden's| > {contribution_limit(settings):g}; "
            "goldens without the precision floor use the table policy"
        )
    return (
        f"table policy: fail on NaN/Inf, max_abs_diff > {settings.max_abs_diff:g}, mean_abs_diff > "
        f"{settings.max_mean_abs_diff:g}, similarity_percentage < {settings.min_similarity:g}, "
        f"cosine_similarity < {table_min_cosine(settings):g}, pearson_correlation < {settings.min_pearson:g}"
    )
