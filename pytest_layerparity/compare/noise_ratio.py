"""The noise ratio ``||target - floor|| / ||golden - floor||`` in float64, chunk by chunk
(:mod:`.chunks`): how much further from the float32 evaluation the target is than the golden."""

from __future__ import annotations

import math

import torch

from .chunks import Chunks, as_tensor, check_shapes, to_host


def noise_sums(g, t, r, a, b) -> list[torch.Tensor]:
    torch.sub(t, r, out=a)
    torch.sub(g, r, out=b)
    return [torch.dot(a, a), torch.dot(b, b)]


def noise_ratio_of(rows: list[list[torch.Tensor]], eps: float) -> float:
    """The noise ratio from the chunks' :func:`noise_sums`."""
    host = to_host(rows)
    return _ratio(math.fsum(r[0] for r in host), math.fsum(r[1] for r in host), eps)


def _ratio(num_sq: float, den_sq: float, eps: float) -> float:
    if num_sq == 0.0 and den_sq == 0.0:
        return 0.0
    return math.sqrt(num_sq) / (math.sqrt(den_sq) + eps)


def noise_ratio(golden, target, floor, eps: float = 1e-12) -> float:
    """``||target - floor||_2 / (||golden - floor||_2 + eps)``, all in float64.

    ``floor`` is typically the float32 evaluation of the same layer: a ratio near 1 says
    the target is no further from it than the golden is (the target is as accurate as the
    golden's own low-precision run). 0.0 when both norms are 0. Taken over all elements, so
    a NaN or Inf anywhere makes the result NaN or Inf.
    """
    golden = as_tensor(golden, "golden")
    target = as_tensor(target, "target")
    floor = as_tensor(floor, "floor")
    check_shapes(golden, target, "target")
    check_shapes(golden, floor, "floor")
    if golden.numel() == 0:
        return 0.0
    with torch.no_grad(), Chunks([golden, target, floor], None, nscratch=2) as ch:
        rows = []
        for i in range(ch.nchunks):
            pair, (r,) = ch.load(i)
            a, b = ch.scratch_for(r.numel())
            rows.append(noise_sums(pair[0], pair[1], r, a, b))
        return noise_ratio_of(rows, float(eps))
