"""The smallest tolerances with which ``torch.allclose`` would pass, in float64, chunk by
chunk (:mod:`.chunks`)."""

from __future__ import annotations

import math

import torch

from .chunks import Chunks, as_tensor, check_shapes


def min_passing_tolerance(golden, target) -> dict:
    """The smallest tolerances with which ``torch.allclose(target, golden)`` would pass.

    ``{"atol": max |t-g|`` (passes with rtol=0), ``"rtol": max |t-g|/|g|`` over ``g != 0``
    (passes with atol=0; ``inf`` when some ``g == 0`` has ``t != g``)``}``, in float64.
    Equal values (equal infinities included) always pass; a NaN, or an infinity that the
    other tensor does not match exactly, makes both ``inf`` (no tolerance passes).
    Empty tensors: both 0.0.
    """
    golden = as_tensor(golden, "golden")
    target = as_tensor(target, "target")
    check_shapes(golden, target, "target")
    inf = float("inf")
    if golden.numel() == 0:
        return {"atol": 0.0, "rtol": 0.0}
    maxima = []
    with torch.no_grad(), Chunks([golden, target], None, nscratch=0) as ch:
        zero = torch.zeros((), dtype=torch.float64, device=ch.device)
        for i in range(ch.nchunks):
            pair, _ = ch.load(i)
            g, t = pair[0], pair[1]
            eq = g == t
            d = torch.where(eq, zero, (t - g).abs())  # NaN/Inf where no tolerance can pass
            ratio = torch.where(eq, zero, d / g.abs())  # g == 0 != t -> inf
            maxima.append(torch.stack([d.amax(), ratio.amax()]))
        host = torch.stack(maxima).cpu().tolist()
    if not all(math.isfinite(x[0]) for x in host):
        return {"atol": inf, "rtol": inf}
    return {"atol": max(x[0] for x in host), "rtol": max(x[1] for x in host)}
