"""The rounding model of the perturbed runs (:mod:`.perturb`): which ops round at all
(``EXACT_OPS`` do not), each dtype's unit roundoff, another legitimate rounding of an op's
result given the op computed one precision wider (:func:`stochastic_round`,
:func:`another_rounding`). A matmul's sums in order: :mod:`.sums`."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from .draws import counter_halves, counter_key, random_halves

# Ops whose floating results involve no rounding (data movement, selection, exact arithmetic).
EXACT_OPS = frozenset(
    {
        "clone",
        "copy",
        "copy_",
        "cat",
        "stack",
        "slice",
        "select",
        "index",
        "index_select",
        "gather",
        "scatter",
        "expand",
        "permute",
        "transpose",
        "t",
        "view",
        "_unsafe_view",
        "reshape",
        "unsqueeze",
        "squeeze",
        "split",
        "split_with_sizes",
        "chunk",
        "narrow",
        "where",
        "masked_fill",
        "masked_fill_",
        "zeros",
        "zeros_like",
        "ones",
        "ones_like",
        "full",
        "full_like",
        "empty",
        "empty_like",
        "new_zeros",
        "new_ones",
        "new_empty",
        "new_full",
        "arange",
        "embedding",
        "neg",
        "abs",
        "relu",
        "max",
        "min",
        "amax",
        "amin",
        "topk",
        "sort",
        "argmax",
        "argmin",
        "lift_fresh",
        "lift_fresh_copy",
        "detach",
        "alias",
        "_to_copy",
        "to",
        "flip",
        "roll",
        "repeat",
        "index_put",
        "index_put_",
        "fill",
        "fill_",
        "zero_",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "logical_not",
        "logical_and",
        "logical_or",
        "isnan",
        "isinf",
        "isfinite",
        "sign",
        "clamp_min",
        "clamp_max",
        "clamp",
        "triu",
        "tril",
        "constant_pad_nd",
        "pad",
        "unbind",
        "diagonal",
        "as_strided",
        "scalar_tensor",
        "_softmax_backward_data",
        "one_hot",
        "bitwise_not",
        "bitwise_and",
        "bitwise_or",
        "nonzero",
        "unique",
        "histc",
        "bincount",
        "floor",
        "ceil",
        "round",
        "trunc",
        "maximum",
        "minimum",
        "masked_scatter",
        "index_add",
        "index_add_",
        "scatter_add",
        "scatter_add_",
        "_local_scalar_dense",
        "item",
        "sym_size",
        "sym_stride",
        "sym_numel",
    }
)
_UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24, torch.float64: 2.0**-53}
_WIDER = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.float32: torch.float64}


def unit_roundoff(dtype: torch.dtype) -> float:
    return _UNIT_ROUNDOFF[dtype]


def _may_round(func: Any) -> bool:
    """Whether ``func`` is an op that may round at all (not data movement or exact arithmetic)."""
    name = func.overloadpacket.__name__
    return not (name in EXACT_OPS or name.rstrip("_") in EXACT_OPS or getattr(func, "is_view", False))


def _rounds(func: Any, args: tuple, out: Any) -> bool:
    """Whether ``func``'s floating results are rounded (and so may be perturbed)."""
    name = func.overloadpacket.__name__
    if name == "_to_copy":  # a conversion rounds only when it narrows
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        return (
            source is not None
            and isinstance(out, torch.Tensor)
            and source.is_floating_point()
            and out.is_floating_point()
            and _UNIT_ROUNDOFF.get(out.dtype, 0) > _UNIT_ROUNDOFF.get(source.dtype, 0)
        )
    return _may_round(func)


def stochastic_round(
    exact: torch.Tensor, dtype: torch.dtype, generator: torch.Generator, draw: torch.Tensor | None = None
) -> torch.Tensor:
    """``exact`` (a wider dtype) rounded to ``dtype`` up or down at random, each neighbour
    with probability in proportion to its closeness (unbiased: E[result] = exact). ``draw``:
    the uniform draws in [0, 1) to use, one per element (else drawn from ``generator``)."""
    # In place where it can be (the same values): a perturbed op's temporaries are the peak of
    # extraction's perturbed runs, several copies of the op's result one precision wider.
    nearest = exact.to(dtype)
    back = nearest.to(exact.dtype)
    toward = torch.full_like(nearest, -float("inf")).masked_fill_(back < exact, float("inf"))
    other = torch.nextafter(nearest, toward)
    del toward
    p_other = (exact - back).abs_()
    gap = other.to(exact.dtype).sub_(back).abs_()
    p_other.div_(gap).nan_to_num_(0.0).clamp_(0, 1)
    del gap
    if draw is None:
        draw = torch.rand(exact.shape, generator=generator, dtype=exact.dtype, device=exact.device)
    take = draw < p_other
    del draw, p_other
    take &= torch.isfinite(other)
    take &= back != exact
    del back
    return torch.where(take, other, nearest)


#: Elements another_rounding works on at once (on the CPU): its wide temporaries (the error,
#: the point reached, the rounding's draws) are a block's, not several copies of the result,
#: and stay in the cache between its passes (measured on 2M bfloat16 results from cold
#: memory: 2.7 ns an element in blocks of 2^18, 6.1 in blocks of 2^20).
ROUNDING_BLOCK = 1 << 18
#: Bits of the uniform draw of each element after its sign bit (:func:`counter_halves`): a
#: point placed within an ulp to 1/16384 of it, far finer than the rounding that follows.
UNIFORM_BITS = 14

#: Per (narrow dtype, wide dtype): how many low bits of the wide dtype's significand lie below
#: the narrow one's (:func:`_round_away_at_random`: rounding by integer arithmetic on the bits).
_DROPPED_BITS = {
    (torch.bfloat16, torch.float32): 16,
    (torch.float16, torch.float32): 13,
    (torch.float32, torch.float64): 29,
}
_SAME_WIDTH_INT = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def another_rounding(
    result: torch.Tensor,
    wide: torch.Tensor,
    generator: torch.Generator,
    jitter: bool = False,
    scale: float = 1.0,
    draws: Callable[[int, int], torch.Tensor] | None = None,
    pull: float | None = None,
) -> torch.Tensor:
    """Another legitimate value of an op's ``result``, given the op computed one precision
    wider (``wide``): per element, the result's error against ``wide`` is kept or reflected
    (at random, half and half), and the point reached is rounded stochastically. With
    ``pull``, the error is neither kept nor reflected but that fraction of it taken (the
    point between ``wide`` and the result), and the draw's sign bit goes unused.

    For an elementwise op (``result`` is ``wide`` rounded to nearest) this is exactly
    stochastic rounding of ``wide``. For a reduction (a matmul or a sum accumulated in the
    result's dtype) it keeps the size of the accumulation error while drawing its sign anew,
    as another reduction order would; recomputing wider alone would drop that error and
    make every run more accurate than the golden. ``scale`` multiplies both errors: a kernel
    that is that many times less accurate than the reference's.

    Each element's randomness is one 15-bit draw: its lowest bit the sign, the rest
    (``UNIFORM_BITS``) a uniform number in (0, 1), at the middle of one of 2^14 equal steps,
    for the jitter or the stochastic rounding; on the CPU :func:`counter_halves` of a key
    drawn from ``generator``, elsewhere :func:`random_halves`. On the CPU a result of more
    than ``ROUNDING_BLOCK`` elements is worked through in blocks with the same draws as the
    whole. ``draws(start, stop)``: the 15-bit draws of the flat elements ``start`` to ``stop``,
    given (:func:`.functions.keyed_draws`), in place of the generator's."""
    n = wide.numel()
    if wide.device.type != "cpu":
        return _another_rounding(result, wide, generator, jitter, scale, None if draws is None else draws(0, n), pull)
    if draws is None:
        draws = partial(counter_halves, counter_key(generator))
    if n <= ROUNDING_BLOCK:
        return _another_rounding(result, wide, generator, jitter, scale, draws(0, n), pull)
    out = torch.empty(wide.shape, dtype=result.dtype, device=wide.device)
    flat_out, flat_result, flat_wide = out.view(-1), result.reshape(-1), wide.reshape(-1)
    for start in range(0, n, ROUNDING_BLOCK):
        stop = min(start + ROUNDING_BLOCK, n)
        given = draws(start, stop)
        part = _another_rounding(flat_result[start:stop], flat_wide[start:stop], generator, jitter, scale, given, pull)
        flat_out[start:stop] = part
        del part
    return out


def _another_rounding(
    result: torch.Tensor,
    wide: torch.Tensor,
    generator: torch.Generator,
    jitter: bool,
    scale: float,
    bits: torch.Tensor | None = None,
    pull: float | None = None,
) -> torch.Tensor:
    """:func:`another_rounding` of one block."""
    if bits is None:
        bits = random_halves(wide.numel(), generator, wide.device)
    bits = bits.view(wide.shape)  # used up in place below
    if pull is not None:  # result * f + wide * (1 - f) in two passes (an infinite result stays infinite)
        factor = scale * pull
        point = result.to(wide.dtype)
        if factor != 1.0:
            point.mul_(factor).add_(wide, alpha=1 - factor)
    else:
        # the error where it is finite, else none (an infinite or NaN result is kept as computed)
        point = result.to(wide.dtype).sub_(wide).nan_to_num_(0.0, 0.0, 0.0)
        flip = (bits & 1).bitwise_xor_(1).to(_SAME_WIDTH_INT[wide.dtype])  # the lowest bit 1: kept, 0: reflected
        point.view(flip.dtype).bitwise_xor_(flip.bitwise_left_shift_(8 * wide.element_size() - 1))
        del flip
        if scale != 1.0:
            point.mul_(scale)
        point.add_(wide)  # wide + sign * error * scale
    if jitter:  # anywhere within half an ulp (times scale) of the point, then to nearest
        steps = bits.bitwise_right_shift_(1)  # the uniform number is (steps + 0.5) / 2^UNIFORM_BITS
        u = _UNIT_ROUNDOFF[result.dtype] * scale
        step = 2 * u * 2.0**-UNIFORM_BITS
        factor = steps.to(wide.dtype).mul_(step).add_(1 - u + step / 2)  # 1 + u * (2 uniform - 1)
        return point.mul_(factor).to(result.dtype)
    return _round_away_at_random(point, result.dtype, bits)


def _uniform(steps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The uniform numbers (steps + 0.5) / 2^UNIFORM_BITS in ``dtype``."""
    return steps.to(dtype).add_(0.5).mul_(2.0**-UNIFORM_BITS)


def _round_away_at_random(point: torch.Tensor, dtype: torch.dtype, bits: torch.Tensor) -> torch.Tensor:
    """``point`` (the wide dtype) stochastically rounded to ``dtype``, given each element's
    15-bit draw ``bits`` (:mod:`.draws`), whose uniform number is (steps + 0.5) /
    2^UNIFORM_BITS for steps = bits >> 1. Where ``dtype``'s normal numbers hold the point's
    neighbours, by integer arithmetic on its bits: a draw spread over the bits below
    ``dtype``'s significand is added to them and they are cleared, so the point goes to its
    neighbour away from zero with the probability of its distance from the one toward zero
    (the draw is (steps + 0.5) / 2^14 where 15 or more bits are dropped, (2 steps + 1) placed
    just below them; float16 drops 13 from float32 and takes the top 13 of the 14, which
    makes it exactly unbiased). A fifth to a third of the work of :func:`stochastic_round`,
    which takes the rest (below ``dtype``'s smallest normal, zero excepted; beyond its largest
    finite value; infinities and NaNs: one reduction tells whether there are any where no
    subnormal can be), any other pair of dtypes and every element off the CPU (where telling
    those apart would wait for the device at every op). ``point`` and ``bits`` are
    overwritten."""
    drop = _DROPPED_BITS.get((dtype, point.dtype))
    if drop is None or point.device.type != "cpu":
        return stochastic_round(point, dtype, None, _uniform(bits.bitwise_right_shift_(1), point.dtype))
    info = torch.finfo(dtype)
    subnormals = torch.finfo(point.dtype).tiny < info.tiny  # a narrower exponent range: its subnormals too
    aside = None
    per_element = subnormals  # else one reduction tells whether any value lies beyond dtype's range
    if not subnormals:
        low, high = torch.aminmax(point)
        per_element = not -info.max <= float(low) <= float(high) <= info.max  # NaN fails too
    if per_element:
        size = point.abs()
        odd = size <= info.max
        odd.logical_not_()  # NaN, an infinity, or beyond dtype's largest finite value
        if subnormals:
            odd |= (size < info.tiny) & (size != 0)
        del size
        if bool(odd.any()):
            aside = (odd, point[odd], bits[odd] >> 1)
        else:
            del odd
    ints = point.view(_SAME_WIDTH_INT[point.dtype])
    if drop >= UNIFORM_BITS + 1:  # (2 steps + 1) at the top of the dropped bits: the middle of a step
        ints.add_(bits.bitwise_or_(1).to(ints.dtype), alpha=1 << (drop - UNIFORM_BITS - 1))
    else:  # (one dtype: a mixed one takes a slower path)
        ints.add_(bits.bitwise_right_shift_(UNIFORM_BITS + 1 - drop).to(ints.dtype))
    ints.bitwise_and_(-(1 << drop))
    out = point.to(dtype)  # exact: the point is on dtype's grid now
    if aside is not None:
        odd, values, their_steps = aside
        out[odd] = stochastic_round(values, dtype, None, _uniform(their_steps, values.dtype))
    return out
