"""One chunk's float64 sums and maxima over its all-finite pairs (:class:`ChunkStats`), and
those of all the chunks added up (:class:`Totals`): every statistic of :mod:`.metrics` is
taken from them. Sums are float64 reductions per chunk (``torch.sum``/``torch.dot`` on
float64), and the per-chunk partial sums are added with :func:`math.fsum`."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

#: The ``tiny`` of ``max_rel_diff = max |t-g| / (|g| + tiny)``: the smallest normal float64.
#: For bf16/fp16/fp32/integer goldens ``|g| + tiny == |g|`` exactly whenever ``g != 0``.
REL_TINY: float = float(torch.finfo(torch.float64).tiny)


class ChunkStats(NamedTuple):
    """One chunk's float64 sums and maxima over its all-finite pairs, on the host: what
    :func:`chunk_stats` computes, in this order."""

    sum_g: float
    sum_t: float
    sum_gg: float
    sum_tt: float
    sum_gt: float
    sum_abs_diff: float
    max_abs_diff: float
    max_rel_diff: float
    outside: float  # pairs outside the similarity tolerance


def chunk_stats(pair, d, a, b, atol: float, rtol: float) -> list[torch.Tensor]:
    """float64 sums and maxima over one chunk of all-finite pairs (0-d tensors, no sync), in
    the order of :class:`ChunkStats`.

    ``pair``: (2, m) float64, golden in row 0, target in row 1; d, a, b: scratch of m.
    """
    g, t = pair[0], pair[1]
    out = list(pair.sum(1).unbind())
    out += [torch.dot(g, g), torch.dot(t, t), torch.dot(g, t)]
    torch.sub(t, g, out=d)
    d.abs_()  # |t - g|, bitwise what (t.double() - g.double()).abs() gives
    out.append(d.sum())
    out.append(d.amax())
    torch.abs(g, out=a)
    torch.add(a, REL_TINY, out=b)
    torch.div(d, b, out=b)
    out.append(b.amax())  # max relative difference
    a.mul_(rtol).add_(atol)  # tolerance: atol + rtol * |g|, same rounding as isclose
    torch.gt(d, a, out=b)  # 1.0 where outside the tolerance
    out.append(b.sum())
    return out


class Totals(NamedTuple):
    """The statistics of the chunks that hold finite pairs, added up: sums exactly
    (:func:`math.fsum` of the per-chunk float64 sums), maxima over the chunks."""

    n: int  # the pairs where both values are finite
    sum_g: float
    sum_t: float
    sum_gg: float
    sum_tt: float
    sum_gt: float
    sum_abs_diff: float
    max_abs_diff: float
    max_rel_diff: float
    outside: float

    @classmethod
    def of(cls, chunks: list[ChunkStats], n: int) -> Totals:
        def total(name: str) -> float:
            return math.fsum(getattr(c, name) for c in chunks)

        return cls(
            n=n,
            sum_g=total("sum_g"),
            sum_t=total("sum_t"),
            sum_gg=total("sum_gg"),
            sum_tt=total("sum_tt"),
            sum_gt=total("sum_gt"),
            sum_abs_diff=total("sum_abs_diff"),
            max_abs_diff=max(c.max_abs_diff for c in chunks),
            max_rel_diff=max(c.max_rel_diff for c in chunks),
            outside=total("outside"),
        )
