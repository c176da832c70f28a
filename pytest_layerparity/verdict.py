"""Thresholds and the pass/fail verdict of one comparison.

Two policies:

* ``noise`` (the default): fail on NaN/Inf, on a cosine below the floor, or when the target's
  error against a higher-precision evaluation of the layer is more than a few times the
  golden's own rounding error, tensor-wide (``noise_ratio``) or on any one token
  (``token_noise_ratio``). Needs goldens that carry the precision floor (``ref_output``); for
  goldens without it the ``table`` policy applies.
* ``table``: the seeds' fixed table (max/mean abs diff, similarity, cosine, Pearson).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Per golden dtype: (max_noise_ratio, max_token_noise_ratio, min_cosine). Chosen from the
# measurements in bench/bench_verdicts.py (see README, "Choosing the default verdict"):
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


@dataclass(frozen=True)
class Check:
    """One metric against its threshold."""

    name: str
    value: float
    op: str  # "<=" (value must not exceed limit), ">=" (must reach limit), "==" for counts
    limit: float
    ok: bool

    def describe(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        return f"{self.name:<22} {_fmt(self.value):>14}   {self.op} {_fmt(self.limit):<10} {verdict}"


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


def noise_limits(settings: Any, dtype: str) -> tuple[float, float, float]:
    """(max_noise_ratio, max_token_noise_ratio, min_cosine) in force for ``dtype``."""
    ratio, token, cosine = NOISE_DEFAULTS.get(dtype, NOISE_DEFAULTS["bfloat16"])
    return (
        settings.max_noise_ratio if settings.max_noise_ratio is not None else ratio,
        settings.max_token_noise_ratio if settings.max_token_noise_ratio is not None else token,
        settings.min_cosine if settings.min_cosine is not None else cosine,
    )


def policy_in_force(settings: Any, has_floor: bool) -> str:
    return "noise" if settings.verdict == "noise" and has_floor else "table"


def evaluate(metrics: Any, settings: Any, noise: Any = None, dtype: str = "bfloat16") -> list[Check]:
    non_finite = metrics.golden_nan + metrics.golden_inf + metrics.target_nan + metrics.target_inf
    checks = [Check("nan_inf_count", non_finite, "==", 0, non_finite == 0)]
    if policy_in_force(settings, noise is not None) == "noise":
        max_ratio, max_token, min_cos = noise_limits(settings, dtype)
        checks += [
            _lower("cosine_similarity", metrics.cosine_similarity, min_cos),
            _upper("noise_ratio", noise.noise_ratio, max_ratio),
            _upper("token_noise_ratio", noise.token_noise_ratio, max_token),
        ]
        if noise.contribution_z is not None:
            limit = settings.max_contribution_z if settings.max_contribution_z is not None else MAX_CONTRIBUTION_Z
            checks.append(_upper("contribution_bias", abs(noise.contribution_z), limit))
        return checks
    return checks + [
        _upper("max_abs_diff", metrics.max_abs_diff, settings.max_abs_diff),
        _upper("mean_abs_diff", metrics.mean_abs_diff, settings.max_mean_abs_diff),
        _lower("similarity_percentage", metrics.similarity_percentage, settings.min_similarity),
        _lower("cosine_similarity", metrics.cosine_similarity, settings.min_cosine if settings.min_cosine is not None else 0.99),
        _lower("pearson_correlation", metrics.pearson_correlation, settings.min_pearson),
    ]


def describe_rule(settings: Any, dtype: str) -> str:
    if settings.verdict == "noise":
        ratio, token, cosine = noise_limits(settings, dtype)
        return (f"noise policy ({dtype}): fail on NaN/Inf, cosine_similarity < {cosine:g}, "
                f"noise_ratio > {ratio:g}, token_noise_ratio > {token:g} or contribution_bias > "
                f"{settings.max_contribution_z if settings.max_contribution_z is not None else MAX_CONTRIBUTION_Z:g} "
                "(error against the float32/float64 evaluation, in units of the golden's own error); "
                "goldens without the precision floor use the table policy")
    return ("table policy: fail on NaN/Inf, max_abs_diff > {:g}, mean_abs_diff > {:g}, similarity_percentage < {:g}, "
            "cosine_similarity < {:g}, pearson_correlation < {:g}").format(
        settings.max_abs_diff, settings.max_mean_abs_diff, settings.min_similarity,
        settings.min_cosine if settings.min_cosine is not None else 0.99, settings.min_pearson)
