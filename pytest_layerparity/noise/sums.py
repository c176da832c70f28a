"""A matmul's products summed in order, one at a time, as a lowering that does so sums them:
the size of that sum's error (:func:`sequential_sum_error_std`, and a draw of it,
:func:`accumulation_error`) and the sum itself, each product fused into the partial sum
(:func:`fused_sequential_sum`)."""

from __future__ import annotations

import math

import torch

from .rounding import _UNIT_ROUNDOFF, _WIDER

#: Checkpoints along the summed dimension at which the partial sums are computed exactly.
_CHECKPOINTS = 8


def sequential_sum_error_std(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The standard deviation of the error of ``a @ b`` (batched or not) summed sequentially
    in ``dtype``: each of the k additions rounds its partial sum S_j to nearest, an error
    uniform within half an ulp of S_j, of variance u^2 S_j^2 / (8 ln 2) over S_j's position
    within its binade, so the total's is u^2 / (8 ln 2) * sum_j S_j^2. The partial sums are
    computed exactly at ``_CHECKPOINTS`` points along k (block products, same work as one
    matmul); between two checkpoints S_j runs from one to the next (the straight part) with
    a random-walk bridge around it (sixth of the block's sum of squared products)."""
    wide = _WIDER.get(dtype, torch.float32)
    a, b = a.detach().to(wide), b.detach().to(wide)
    k = a.shape[-1]
    step = max(1, -(-k // _CHECKPOINTS))
    total = torch.zeros(a.shape[:-1] + b.shape[-1:], dtype=wide, device=a.device)
    before = torch.zeros_like(total)
    for start in range(0, k, step):
        width = min(step, k - start)
        after = before + a[..., start : start + width] @ b[..., start : start + width, :]
        total += width * (before * before + before * after + after * after) / 3
        before = after
    total += step * ((a * a) @ (b * b)) / 6
    return (_UNIT_ROUNDOFF[dtype] ** 2 * total / (8 * math.log(2))).sqrt()


def fused_sequential_sum(a: torch.Tensor, b: torch.Tensor, initial: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` (batched or not) in ``a``'s dtype as a sum in order computes it: from
    ``initial`` (broadcast to the result; zero where not given), each product fused into the
    partial sum with one rounding (a fused multiply-add; the float64 sum of two float32s and
    their exact product rounds as one), one product at a time along k. XLA's CPU backend
    computes a float32 one-row dot so, from its bias where fused with one: bit for bit at k 64
    to 8192 (``bench/bench_xla_kernels.py --one-row``). The rounding errors are those of this
    data, not a draw of their size: a trained layer's few large biases (Qwen2.5's keys, up to
    145) leave its error on a few channels, whose draws moved a decode step's scores 4.4 times
    what the sum itself does."""
    wide = _WIDER.get(a.dtype, torch.float64)
    shape = a.shape[:-1] + b.shape[-1:]
    total = torch.zeros(shape, dtype=a.dtype, device=a.device)
    if initial is not None:
        total.copy_(initial.expand(shape))
    a, b = a.detach(), b.detach()
    for i in range(a.shape[-1]):
        total = (total.to(wide) + a[..., i : i + 1].to(wide) * b[..., i : i + 1, :].to(wide)).to(a.dtype)
    return total


#: Matmul ops, by packet name, with the positions of their two factors (m x k and k x n).
ACCUMULATING_OPS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2)}


def accumulation_error(name: str, args: tuple, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """A draw of the error of summing matmul ``name``'s products (``ACCUMULATING_OPS``) in
    ``dtype``: Gaussian, the size :func:`sequential_sum_error_std` gives."""
    first, second = ACCUMULATING_OPS[name]
    std = sequential_sum_error_std(args[first], args[second], dtype)
    return std * torch.randn(std.shape, generator=generator, dtype=std.dtype, device=std.device)
