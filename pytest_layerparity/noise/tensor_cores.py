"""A float32 attention as a fused kernel on tensor cores returns it: its results leaning
toward zero, one legitimate way that half the perturbed runs take (:mod:`.perturb`).

PyTorch's memory-efficient attention (what ``scaled_dot_product_attention`` runs in float32 on
CUDA from compute capability 8.0, where neither flash nor cuDNN take float32) computes both of
its matmuls on tensor cores in three TF32 passes (CUTLASS's ``OpMultiplyAddFastF32``), whose
sums round toward zero (Fasi, Higham, Mikaitis and Pranesh, 2021). Its results are smaller in
magnitude than the exact attention's, every element the same way: a lean that no draw of an
error's sign per element reproduces and that does not average out over a layer's elements as
drawn errors do. On an H200, layers of GPT-NeoX and Phi so computed read beyond runs without
it (``branch_bias_attention`` up to 2.0 times its limit) while their noise_ratio stayed below
1, and the kernel leaned by 1.4, 3.1 and 3.6 ulps of each result (the mean, causal attention
of 32, 512 and 2048 tokens; bench/bench_tensor_core_attention.py, bench/README.md).

The lean grows with the keys a query sees: on the H200, a decode step's one query leaned by 0.0
ulps over 9 keys, 2.9 over 33 and 3.0 to 4.2 over 65 to 4096 (each result its keys' sum); a
causal prompt's rows, which see 1 to N keys, by 0.3, 1.3 and 2.6 at N = 8, 32 and 128. A run
that takes this way moves each result of such an attention, from its wider value, toward zero
by :func:`lean_ulps` of the keys its row sees, ulps of its own on average: a uniform draw per
element of none to twice that less one, then rounded toward zero (half an ulp more on
average); a row that sees ``LEAN_FROM_KEYS`` or fewer keys keeps its perturbed value.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .wider import _named_arguments, causal_seen, with_rows

#: How far, on average, a fused float32 attention on tensor cores moves the results of a row
#: that sees ``FULL_LEAN_KEYS`` or more keys toward zero, in ulps of each: about the largest
#: lean measured on an H200 (3.6 at 2048 tokens, 4.2 at a decode step over 4096 keys).
LEAN_ULPS = 4.0

#: Up to this many keys a row takes no lean; from there to ``FULL_LEAN_KEYS`` its lean grows
#: with the keys' logarithm (:func:`lean_ulps`), a third above the leans measured
#: (``bench/bench_tensor_core_attention.py``, bench/README.md).
LEAN_FROM_KEYS = 8
FULL_LEAN_KEYS = 32


def float32_ulp(x: torch.Tensor) -> torch.Tensor:
    """The float32 ulp at each element of ``x`` (float64; the smallest normal's below it)."""
    _, exponent = torch.frexp(x.abs().clamp_min(torch.finfo(torch.float32).tiny))
    return torch.ldexp(torch.ones_like(x), exponent - 24)


def toward_zero(x: torch.Tensor) -> torch.Tensor:
    """Float64 ``x`` rounded to float32 toward zero."""
    rounded = x.to(torch.float32)
    over = rounded.to(torch.float64).abs() > x.abs()
    return torch.where(over, (rounded.view(torch.int32) - 1).view(torch.float32), rounded)


def lean_ulps(keys: torch.Tensor) -> torch.Tensor:
    """The mean lean (ulps of each result, float64) of a row that sees ``keys`` keys: none
    up to ``LEAN_FROM_KEYS``, ``LEAN_ULPS`` from ``FULL_LEAN_KEYS``, linear in the keys'
    logarithm between."""
    ramp = torch.log2(keys.double().clamp_min(1) / LEAN_FROM_KEYS) / math.log2(FULL_LEAN_KEYS / LEAN_FROM_KEYS)
    return ramp.clamp_(0, 1).mul_(LEAN_ULPS)


def seen_keys(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """How many keys each query row of a fused attention op sees (int64, the shape of the
    output's rows, ``[..., queries]``, broadcastable to the output less its last dimension):
    those its mask lets through (a boolean mask's True, an additive one's above its dtype's
    lowest value), of them the first ``i + 1`` for query ``i`` where the op is causal (top-left
    aligned, as :func:`.wider.attention_reference` reads it)."""
    named = _named_arguments(func, args, kwargs)
    query, key = named["query"], named["key"]
    queries, keys = query.shape[-2], key.shape[-2]
    mask = named.get("attn_mask", named.get("attn_bias"))
    through = None
    if isinstance(mask, torch.Tensor):
        through = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
    if named.get("is_causal", False):
        if through is None:
            return torch.arange(1, queries + 1, device=query.device).clamp_max_(keys)
        through = through & causal_seen(0, queries, keys, query.device)
    if through is None:
        return torch.full((queries,), keys, dtype=torch.int64, device=query.device)
    return through.sum(-1)


def leaned(wide: torch.Tensor, generator: torch.Generator, ulps: torch.Tensor | float = LEAN_ULPS) -> torch.Tensor:
    """Float32 results leaning toward zero from their wider values ``wide`` (float64): each
    moved by a uniform draw of 0 to ``2 * ulps - 1`` of its ulps (``ulps`` per element,
    broadcast, at least half an ulp), then rounded toward zero (half an ulp more on average)."""
    wide = wide.double()
    steps = torch.rand(wide.shape, generator=generator, dtype=torch.float64, device=wide.device)
    span = torch.as_tensor(ulps, dtype=torch.float64, device=wide.device).mul(2).sub_(1).clamp_(min=0)
    shift = steps.mul_(span).mul_(float32_ulp(wide))
    return toward_zero(wide - wide.sign() * shift)


def with_tensor_core_rows(
    func: Any,
    args: tuple,
    kwargs: dict,
    result: Any,
    wide: torch.Tensor,
    keep: torch.Tensor,
    generator: torch.Generator,
) -> Any:
    """``result`` of the fused attention op ``func`` on ``args``, ``kwargs`` (its output
    first) with the rows that ``keep`` marks (one boolean per row of the output's first
    dimension) as tensor cores return them: their values one precision wider (``wide``, the
    output's shape), :func:`leaned` by the :func:`lean_ulps` of the keys each query sees
    (:func:`seen_keys`); a query that sees too few to lean keeps its value. No row marked:
    ``result`` as it is."""
    if not keep.any():
        return result
    rows = keep.nonzero().squeeze(1)
    first = result[0] if isinstance(result, tuple) else result
    lean = lean_ulps(seen_keys(func, args, kwargs))[..., None]
    lean = lean.expand(*first.shape[:-1], 1)[rows] if lean.dim() == first.dim() else lean
    return with_rows(result, rows, torch.where(lean > 0, leaned(wide[rows], generator, lean), first[rows]))
