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

A run that takes this way moves each result of such an attention, from its wider value,
toward zero by ``LEAN_ULPS`` ulps of its own on average: a uniform draw per element of none to
``2 * LEAN_ULPS - 1`` ulps, then rounded toward zero (half an ulp more on average).
"""

from __future__ import annotations

from typing import Any

import torch

#: How far, on average, a fused float32 attention on tensor cores moves its results toward
#: zero, in ulps of each: the largest lean measured on an H200 (3.6, at 2048 tokens), rounded up.
LEAN_ULPS = 4.0


def float32_ulp(x: torch.Tensor) -> torch.Tensor:
    """The float32 ulp at each element of ``x`` (float64; the smallest normal's below it)."""
    _, exponent = torch.frexp(x.abs().clamp_min(torch.finfo(torch.float32).tiny))
    return torch.ldexp(torch.ones_like(x), exponent - 24)


def toward_zero(x: torch.Tensor) -> torch.Tensor:
    """Float64 ``x`` rounded to float32 toward zero."""
    rounded = x.to(torch.float32)
    over = rounded.to(torch.float64).abs() > x.abs()
    return torch.where(over, (rounded.view(torch.int32) - 1).view(torch.float32), rounded)


def leaned(wide: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Float32 results leaning toward zero from their wider values ``wide`` (float64): each
    moved by a uniform draw of 0 to ``2 * LEAN_ULPS - 1`` of its ulps, then rounded toward
    zero (half an ulp more on average)."""
    wide = wide.double()
    steps = torch.rand(wide.shape, generator=generator, dtype=torch.float64, device=wide.device)
    shift = steps.mul_(2 * LEAN_ULPS - 1).mul_(float32_ulp(wide))
    return toward_zero(wide - wide.sign() * shift)


def with_tensor_core_rows(result: Any, wide: torch.Tensor, keep: torch.Tensor, generator: torch.Generator) -> Any:
    """``result`` of a fused attention op (its output first) with the rows that ``keep`` marks
    (one boolean per row of the output's first dimension) as tensor cores return them: their
    values one precision wider (``wide``, the output's shape), :func:`leaned`."""
    rows = keep.nonzero().squeeze(1)
    first = result[0] if isinstance(result, tuple) else result
    output = first.index_copy(0, rows, leaned(wide[rows], generator))
    return (output, *result[1:]) if isinstance(result, tuple) else output
