"""Statistics against the precision floor: how far the target is from a higher-precision
evaluation of the same layer (the floor, stored in the golden as ``ref_output``), measured
in units of the golden's own rounding error (its noise).

``noise_ratio = ||target - ref|| / ||golden - ref||`` where ``ref`` is the layer evaluated in
float32 (float64 for float32 goldens). A correct port makes about the same rounding error as
the reference (ratio near 1); a bug adds an error of its own. Per token (rows of the last
dimension) the same ratio, with the golden error floored at its median so that a token the
golden happened to round well does not make a ratio from nothing, shows bugs that touch only
some tokens and that a tensor-wide norm averages away.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

#: The name of the precision floor (the layer evaluated in higher precision) in a golden.
FLOOR_KEY = "ref_output"


@dataclass(frozen=True)
class FloorStats:
    noise_ratio: float
    token_noise_ratio: float  # the largest per-token ratio
    worst_token: int
    golden_error: float  # ||golden - ref|| (the floor)
    target_error: float  # ||target - ref||
    delta_cosine: float | None  # cosine of (target - input) and (golden - input): the layer's own contribution
    tokens: int
    contribution_z: float | None = None  # (target - golden) along the layer's contribution, in noise units
    golden_contribution_z: float | None = None  # (golden - ref) along it: the golden's own bias

    @property
    def contribution_bias(self) -> float | None:
        """The target's error along the layer's contribution relative to the floor (not the
        golden), in noise units: 0 for a target that computes exactly, ``golden_contribution_z``
        for one that rounds as the golden did."""
        if self.contribution_z is None or self.golden_contribution_z is None:
            return None
        return self.contribution_z + self.golden_contribution_z

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def token_mask(rows: int, left_out: Iterable[int]) -> torch.Tensor | None:
    """A boolean mask over ``rows`` tokens that leaves ``left_out`` out, or None when none is."""
    drop = sorted(set(left_out))
    if not drop:
        return None
    keep = torch.ones(rows, dtype=torch.bool)
    keep[drop] = False
    return keep


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().to("cpu", torch.float64)
    return x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)


def floor_stats(
    golden: torch.Tensor,
    target: torch.Tensor,
    reference: torch.Tensor,
    hidden_in: torch.Tensor | None = None,
    keep_tokens: torch.Tensor | None = None,
) -> FloorStats:
    """The statistics against the floor ``reference``, over tokens (optionally only the
    ``keep_tokens`` boolean mask)."""
    g, t, r = _rows(golden), _rows(target), _rows(reference)
    x = _rows(hidden_in) if hidden_in is not None and hidden_in.shape == golden.shape else None
    if keep_tokens is not None:
        g, t, r = g[keep_tokens], t[keep_tokens], r[keep_tokens]
        x = x[keep_tokens] if x is not None else None
    tokens = g.shape[0]
    if tokens == 0:
        return FloorStats(0.0, 0.0, -1, 0.0, 0.0, None, 0)
    err_g = (g - r).norm(dim=-1)
    err_t = (t - r).norm(dim=-1)
    tiny = 1e-12 * float(r.norm()) + 1e-300
    golden_error = float(err_g.norm())
    target_error = float(err_t.norm())
    ratio = target_error / (golden_error + tiny)
    floor = torch.maximum(err_g, err_g.median()).clamp_min(tiny)
    per_token = err_t / floor
    worst = int(per_token.argmax())
    delta_cos = z_t = z_g = None
    if x is not None:
        dg, dt = (g - x).flatten(), (t - x).flatten()
        denom = float(dg.norm() * dt.norm())
        delta_cos = max(-1.0, min(1.0, float(dg @ dt) / denom)) if denom > 0 else 1.0
        # A bug that scales or skews the layer's own contribution (output - input) leaves a
        # consistent component along it. The golden's rounding may have one too (16-bit
        # rounding of a large contribution is biased), so the target is measured against the
        # golden along that direction, in units of the golden's noise per element.
        u = (r - x).flatten()
        unorm = float(u.norm())
        if unorm > 0 and golden_error > 0:
            u = u / unorm
            scale = (u.numel() ** 0.5) / golden_error
            z_t = float((t - g).flatten() @ u) * scale
            z_g = float((g - r).flatten() @ u) * scale
    return FloorStats(ratio, float(per_token[worst]), worst, golden_error, target_error, delta_cos, tokens, z_t, z_g)
