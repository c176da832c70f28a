"""Thresholds and the pass/fail verdict of one comparison."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Check:
    """One metric against its threshold."""

    name: str
    value: float
    op: str  # "<=" (value must not exceed limit) or ">=" (value must reach limit) or "==" for counts
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


def evaluate(metrics: Any, settings: Any) -> list[Check]:
    """The checks of the seeds' table: each metric against its threshold, and no NaN/Inf."""
    non_finite = metrics.golden_nan + metrics.golden_inf + metrics.target_nan + metrics.target_inf
    return [
        Check("nan_inf_count", non_finite, "==", 0, non_finite == 0),
        _upper("max_abs_diff", metrics.max_abs_diff, settings.max_abs_diff),
        _upper("mean_abs_diff", metrics.mean_abs_diff, settings.max_mean_abs_diff),
        _lower("similarity_percentage", metrics.similarity_percentage, settings.min_similarity),
        _lower("cosine_similarity", metrics.cosine_similarity, settings.min_cosine),
        _lower("pearson_correlation", metrics.pearson_correlation, settings.min_pearson),
    ]
