"""Pointwise ops' results in the perturbed runs (:mod:`.perturb`): the elementwise functions
that kernels approximate (exp, GELU, SiLU, ...) moved within half an ulp before they are
rounded, where other results are rounded stochastically (:func:`approximated`);
the draws of a pointwise op of one 16-bit tensor a function of that tensor's values and of
the run (:func:`keyed_draws`)."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

#: Elementwise functions that kernels compute by approximation (polynomials, tables, several
#: steps) rather than as one correctly rounded operation. torch-xla lowers some of them to
#: several ops that each round to the 16-bit dtype: its bfloat16 GELU errs along GELU's other
#: form 1.6 to 2.2 times a correctly rounded one (bench/README.md), and with these rounded
#: stochastically as the other 16-bit results, a torch-xla BERT layer read beyond its runs.
APPROXIMATED_FUNCTIONS = frozenset(
    {
        "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "pow", "sqrt", "rsqrt",
        "reciprocal", "sigmoid", "silu", "gelu", "tanh", "erf", "erfc", "erfinv", "softplus",
        "elu", "selu", "celu", "mish", "logit", "log_sigmoid_forward", "sin", "cos", "tan",
        "atan", "atan2", "sinh", "cosh", "_softmax", "_log_softmax",
    }
)  # fmt: skip


def approximated(name: str) -> bool:
    """Whether a perturbed run treats op ``name``'s result as an approximated function's
    (``APPROXIMATED_FUNCTIONS``): in the ``"jitter"`` mode moved within half an ulp (times its
    error scale) before it is rounded to nearest, and in float32 or float64 its error against
    the wider result taken ``error_scale`` times (math libraries document 1 to 2 ulp). Any
    other result (matmuls, sums, elementwise arithmetic, conversions) is rounded
    stochastically: in float32 from the reference's error kept or reflected (another kernel
    sums in another order: an error of the reference's size, its sign anew), a 16-bit one
    from halfway to the reference's result (any kernel computes it in float32 and rounds to
    nearest: ``perturb.SIXTEEN_BIT_PULL``). So the runs' largest noise_ratio reads 1.22 times
    a torch-xla port's in bfloat16 (1.35 with 16-bit results rounded stochastically from
    their error kept or reflected, 1.87 with every 16-bit result moved) and 1.43 in float32
    (2.51 with every float32 result moved at twice its error): bench/README.md."""
    return name.rstrip("_") in APPROXIMATED_FUNCTIONS


_MASK31 = (1 << 31) - 1
_MIX = (0x2C1B3C6D, 0x297A2D39, 0x5BD1E995)


def keyed_halves(
    x: torch.Tensor, name: str, seed: int, samples: int = 1, start: int = 0, stop: int | None = None
) -> torch.Tensor:
    """One 15-bit draw per element of a 16-bit ``x`` (int16, as
    :func:`.draws.counter_halves`; of its flat elements ``start`` to ``stop``), a function
    of the element's value, of op ``name`` and of the run: the seed, and with ``samples`` runs
    stacked along the first dimension, the element's run. A kernel computing a function of one
    tensor errs by a fixed amount at each of its values, and a 16-bit tensor takes a few
    thousand values: such errors do not average out along a smooth direction as draws made
    afresh per element do (bench/README.md)."""
    n = x.numel()
    stop = n if stop is None else stop
    rows = x.shape[0] if x.dim() else 1
    runs = samples if x.dim() and samples > 1 and rows % samples == 0 else 1
    key = (seed * 1_000_003 + zlib.crc32(name.encode())) & _MASK31
    h = x.reshape(-1)[start:stop].view(torch.int16).to(torch.int64).bitwise_and_(0xFFFF)
    if runs == 1:  # every element's run is 0: the key alone (five passes fewer)
        h.add_(key)
    else:
        run = torch.arange(start, stop, device=x.device).floor_divide_(max(1, n // runs))
        h.add_(run.mul_(0x10001).add_(key).bitwise_and_(_MASK31))
    for multiplier in _MIX:  # a 31-bit integer mix: xor-shift, then multiply (no overflow in int64)
        h.bitwise_xor_(h >> 15).mul_(multiplier).bitwise_and_(_MASK31)
    return (h >> 8).bitwise_and_(0x7FFF).to(torch.int16)


def keyed_draws(
    func: Any, args: tuple, value: torch.Tensor, seed: int, samples: int
) -> Callable[[int, int], torch.Tensor] | None:
    """The draws of a pointwise op's 16-bit result ``value`` in a run (``seed``; ``samples``
    stacked), keyed by the values of its one tensor operand (:func:`keyed_halves`): the op
    takes one tensor of the result's shape and dtype, the rest scalars (an activation, a
    scale, a shift, a power; a chain of them, as a GELU written out in tensor ops is). Its
    result is then a function of that tensor's values, and so is any kernel's error on it,
    whether the op rounds once or an approximation errs. Returned as the draws of the flat
    elements ``start`` to ``stop`` (a block's at a time: :func:`.rounding.another_rounding`);
    None where they are drawn afresh."""
    if value.dtype not in (torch.bfloat16, torch.float16) or torch.Tag.pointwise not in func.tags:
        return None
    tensors = {id(a): a for a in args if isinstance(a, torch.Tensor) and a.numel() > 1}
    if len(tensors) != 1:
        return None
    (x,) = tensors.values()
    if x.shape != value.shape or x.dtype != value.dtype:
        return None
    # contiguous once: each block's draws read a slice of it (a strided operand would be
    # copied whole for every block otherwise)
    return partial(keyed_halves, x.contiguous(), func.overloadpacket.__name__.rstrip("_"), seed, samples)
