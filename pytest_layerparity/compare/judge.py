"""The judge: a pure function of tensors and settings that says whether a target's output
holds against its golden, and why.

Nothing here loads a model, a store or a device: :func:`judge` takes the golden output, the
target output and (when the golden has them) the precision floor, the layer's input and the
routers' decisions, and returns a :class:`LayerOutcome` with every metric, every check and
the minimum passing tolerance. The plugin, ``python -m pytest_layerparity compare`` and your
own scripts call the same function.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .floor import FLOOR_KEY, FloorStats, floor_stats
from .metrics import Metrics, compare_tensors, min_passing_tolerance
from .routing import RoutingAgreement, agreement, router_names
from .verdict import Check, evaluate

if TYPE_CHECKING:
    from ..options import Settings


@dataclass
class LayerOutcome:
    """The comparison of one layer's target output with its golden."""

    layer: int
    metrics: Metrics
    checks: list[Check]
    shape: tuple[int, ...]
    golden_dtype: str
    target_dtype: str
    floor: FloorStats | None = None
    routing: list[RoutingAgreement] = field(default_factory=list)
    excluded_tokens: list[int] = field(default_factory=list)
    tolerance: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(check.ok for check in self.checks)


def dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def tie_tolerance(settings: Settings, dtype: str) -> float:
    """Router margins (relative to the largest logit) below this count as near ties, for
    goldens without the exact router scores: a few units of the golden dtype's rounding."""
    return settings.router_tie_tolerance * float(torch.finfo(getattr(torch, dtype)).eps)


def judge(
    layer: int,
    golden: torch.Tensor,
    target: torch.Tensor,
    settings: Settings,
    dtype: str,
    *,
    reference: torch.Tensor | None = None,
    hidden_in: torch.Tensor | None = None,
    routing: Sequence[RoutingAgreement] = (),
) -> LayerOutcome:
    """Hold ``target`` against ``golden`` (and against the precision floor ``reference``,
    the layer's input ``hidden_in`` and the routers' agreement, when given)."""
    target_cpu = target.detach().to("cpu")
    if tuple(golden.shape) != tuple(target_cpu.shape):
        raise AssertionError(
            f"layer {layer}: the target's output has shape {tuple(target_cpu.shape)}, the golden "
            f"{tuple(golden.shape)}; the port returns something else than the reference layer"
        )
    routing = list(routing)
    near_ties = sorted({t for r in routing for t in r.near_tie_tokens})
    rows = golden.numel() // golden.shape[-1] if golden.dim() > 1 else 1
    keep = None  # the verdict leaves near-tie routing flips out unless --strict-routing
    if near_ties and golden.dim() > 1 and not settings.strict_routing:
        keep = torch.ones(rows, dtype=torch.bool)
        keep[near_ties] = False
    excluded = near_ties if settings.exclude_near_ties and keep is not None else []
    g_cmp, t_cmp = golden, target_cpu
    if excluded:
        g_cmp = golden.reshape(-1, golden.shape[-1])[keep]
        t_cmp = target_cpu.reshape(-1, golden.shape[-1])[keep]
    metrics = compare_tensors(g_cmp, t_cmp)
    floor = None
    if reference is not None and tuple(reference.shape) == tuple(golden.shape):
        floor = floor_stats(golden, target_cpu, reference, hidden_in, keep)
    return LayerOutcome(
        layer=layer,
        metrics=metrics,
        checks=evaluate(metrics, settings, floor=floor, dtype=dtype),
        shape=tuple(golden.shape),
        golden_dtype=dtype_name(golden),
        target_dtype=dtype_name(target_cpu),
        floor=floor,
        routing=routing,
        excluded_tokens=excluded,
        tolerance=min_passing_tolerance(g_cmp, t_cmp),
    )


def routing_agreements(
    golden_tensors: Mapping[str, torch.Tensor],
    target_routing: Mapping[str, torch.Tensor],
    settings: Settings,
    dtype: str,
) -> list[RoutingAgreement]:
    """The agreement of every router the golden recorded and the target ran."""
    tolerance = tie_tolerance(settings, dtype)
    found = (
        agreement(name, dict(golden_tensors), dict(target_routing), tolerance)
        for name in router_names(dict(golden_tensors))
    )
    return [r for r in found if r is not None]


def judge_golden(
    layer: int,
    golden_tensors: Mapping[str, torch.Tensor],
    output_name: str,
    target: torch.Tensor,
    target_routing: Mapping[str, torch.Tensor],
    settings: Settings,
    dtype: str,
    *,
    hidden_in: torch.Tensor | None = None,
) -> LayerOutcome:
    """:func:`judge` on a golden's tensors: its output ``output_name``, its precision floor
    and recorded routing when it has them; ``hidden_in`` is the layer's input (the golden's
    own unless a chain gives another)."""
    return judge(
        layer,
        golden_tensors[output_name],
        target,
        settings,
        dtype,
        reference=golden_tensors.get(FLOOR_KEY),
        hidden_in=hidden_in,
        routing=routing_agreements(golden_tensors, target_routing, settings, dtype),
    )
