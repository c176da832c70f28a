"""Monte Carlo arithmetic for a PyTorch module: run it with every floating-point op's result
rounded another legitimate way, the way Verificarlo, Verrou and CADNA estimate what
legitimate arithmetic does to a computation.

Under :class:`PerturbedArithmetic`, each op whose result is rounded (matmuls, sums,
elementwise arithmetic, transcendental functions, conversions to a narrower dtype) has its
floating outputs replaced, in one of two modes:

* ``"jitter"`` (the default): the op is computed again one precision wider (float32 for
  16-bit results, float64 for float32 ones); the result's error against that is kept or
  reflected at random per element (so an accumulation error keeps its size but not its
  sign, as another reduction order would), and the point reached is moved anywhere within
  half an ulp and rounded to nearest: an elementwise result is off by up to 1.5 ulp (about
  half an ulp on average), the range of kernels that are not correctly rounded (vendor
  math libraries allow 1 to 2 ulp for exp, erf, rsqrt) rather than the half ulp of correct
  rounding. See :func:`another_rounding`.
* ``"stochastic"`` (Verificarlo's and Verrou's stochastic rounding): the same, with the point
  rounded up or down at random, each neighbour with probability in proportion to its
  closeness (unbiased, correctly-rounded-sized errors: a weaker null).
* ``"random"`` (CADNA's and Verrou's random rounding on the result as computed): the result
  is multiplied by ``1 + u * e`` with ``e`` drawn per element from U(-1, 1), ``u`` the unit
  roundoff of the output's dtype, plus ``u * s`` with ``s`` drawn once per op from
  U(-systematic, systematic) (a consistent sub-ulp bias over a whole result), and rounded back.

Ops that move data without rounding (views, copies, indexing, concatenation, comparisons,
max/min, integer results) are left exact.

Each run under a new seed is one legitimate implementation of the same layer: the spread of
a statistic over runs is what a correct port's statistic is judged against.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

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
MODES = ("jitter", "stochastic", "random")


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


def stochastic_round(exact: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """``exact`` (a wider dtype) rounded to ``dtype`` up or down at random, each neighbour
    with probability in proportion to its closeness (unbiased: E[result] = exact)."""
    nearest = exact.to(dtype)
    back = nearest.to(exact.dtype)
    toward = torch.where(back < exact, torch.full_like(nearest, float("inf")), torch.full_like(nearest, -float("inf")))
    other = torch.nextafter(nearest, toward)
    gap = (other.to(exact.dtype) - back).abs()
    p_other = ((exact - back).abs() / gap).nan_to_num(0.0).clamp(0, 1)
    draw = torch.rand(exact.shape, generator=generator, dtype=exact.dtype, device=exact.device)
    take = (draw < p_other) & torch.isfinite(other) & (back != exact)
    return torch.where(take, other, nearest)


def another_rounding(
    result: torch.Tensor, wide: torch.Tensor, generator: torch.Generator, jitter: bool = False
) -> torch.Tensor:
    """Another legitimate value of an op's ``result``, given the op computed one precision
    wider (``wide``): per element, the result's error against ``wide`` is kept or reflected
    (at random, half and half), and the point reached is rounded stochastically.

    For an elementwise op (``result`` is ``wide`` rounded to nearest) this is exactly
    stochastic rounding of ``wide``. For a reduction (a matmul or a sum accumulated in the
    result's dtype) it keeps the size of the accumulation error while drawing its sign anew,
    as another reduction order would; recomputing wider alone would drop that error and
    make every run more accurate than the golden."""
    error = result.to(wide.dtype) - wide
    sign = torch.randint(0, 2, wide.shape, generator=generator, device=wide.device).to(wide.dtype) * 2 - 1
    point = torch.where(torch.isfinite(error), wide + sign * error, wide)
    if jitter:  # anywhere within half an ulp of the point, then to nearest
        u = _UNIT_ROUNDOFF[result.dtype]
        jitter = torch.rand(wide.shape, generator=generator, dtype=wide.dtype, device=wide.device) * 2 - 1
        return (point * (1 + u * jitter)).to(result.dtype)
    return stochastic_round(point, result.dtype, generator)


def _widen(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in _WIDER:
        return value.detach().to(_WIDER[value.dtype])
    return value


# Fused attention kernels (what scaled_dot_product_attention dispatches to). Called with wider
# inputs, some refuse and some (cuDNN's) return wrong values instead: their wider result is
# computed with the math attention instead (see attention_reference).
FUSED_ATTENTION_OPS = frozenset(
    {
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    }
)


def attention_reference(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """The attention output of a fused attention op (``func`` called with ``args`` and
    ``kwargs``), computed one precision wider by the math attention: the reference its first
    result is perturbed around. Arguments are read by name from the op's schema."""
    named = dict(kwargs)
    for argument, value in zip(func._schema.arguments, args, strict=False):
        named[argument.name] = value
    query, key, value = (_widen(named[n]) for n in ("query", "key", "value"))
    mask = named.get("attn_mask", named.get("attn_bias"))
    output, _ = torch.ops.aten._scaled_dot_product_attention_math(
        query,
        key,
        value,
        _widen(mask),
        0.0,
        bool(named.get("is_causal", False)),
        scale=named.get("scale"),
        enable_gqa=query.shape[-3] != key.shape[-3],
    )
    return output


class PerturbedArithmetic(TorchDispatchMode):
    """While active, rounded floating-point results are rounded another legitimate way (see
    the module's docstring for the two ``mode``s). ``systematic`` scales the per-op bias of
    the random mode. ``ops`` counts the results perturbed."""

    def __init__(self, seed: int, mode: str = "jitter", systematic: float = 0.0) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"unknown perturbation mode {mode!r}; choose one of {', '.join(MODES)}")
        self.seed = seed
        self.mode = mode
        self.systematic = systematic
        self.ops = 0
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def _random(self, tensor: torch.Tensor) -> torch.Tensor:
        u = _UNIT_ROUNDOFF.get(tensor.dtype)
        if u is None or tensor.numel() == 0:
            return tensor
        self.ops += 1
        work = torch.float64 if tensor.device.type == "cpu" or tensor.dtype == torch.float32 else torch.float32
        generator = self._generator(tensor.device)
        noise = torch.rand(tensor.shape, generator=generator, dtype=work, device=tensor.device) * 2 - 1
        bias = (torch.rand((), generator=generator, dtype=work, device=tensor.device) * 2 - 1) * self.systematic
        return (tensor.detach().to(work) * (1 + u * (noise + bias))).to(tensor.dtype)

    def _wider_results(self, func: Any, args: tuple, kwargs: dict) -> list[Any] | None:
        """The op's results computed from its inputs widened one step, or None when it
        cannot be (an op that insists on its dtypes)."""
        if func.overloadpacket.__name__ in FUSED_ATTENTION_OPS:
            return [attention_reference(func, args, kwargs)]
        try:
            exact = func(*tree_map(_widen, args), **tree_map(_widen, kwargs))
        except (RuntimeError, TypeError, NotImplementedError):
            return None
        return tree_flatten(exact)[0]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        exact = None
        if self.mode != "random" and name != "_to_copy" and _may_round(func):
            exact = self._wider_results(func, args, kwargs)  # before an in-place op changes its input
        source = args[0] if name == "_to_copy" and args else None
        out = func(*args, **kwargs)
        if not _rounds(func, args, out):
            return out
        if source is not None:
            exact = [source]
        inputs = {id(a) for a in args if isinstance(a, torch.Tensor)}
        flat, spec = tree_flatten(out)
        results = []
        for i, value in enumerate(flat):
            if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() == 0:
                results.append(value)
                continue
            if self.mode == "random":
                perturbed = self._random(value)
            else:
                wide = exact[i] if exact is not None and i < len(exact) else None
                if (
                    not isinstance(wide, torch.Tensor)
                    or wide.shape != value.shape
                    or _UNIT_ROUNDOFF.get(wide.dtype, 1) >= _UNIT_ROUNDOFF.get(value.dtype, 0)
                ):
                    results.append(value)
                    continue
                self.ops += 1
                perturbed = another_rounding(value, wide, self._generator(value.device), self.mode == "jitter")
            if id(value) in inputs:  # an in-place op: perturb the tensor itself
                value.copy_(perturbed)
                results.append(value)
            else:
                results.append(perturbed)
        return tree_unflatten(results, spec)


def _narrower(dtype: Any, than: torch.dtype) -> bool:
    """Whether ``dtype`` is a floating dtype with less precision than ``than``."""
    return isinstance(dtype, torch.dtype) and _UNIT_ROUNDOFF.get(dtype, 0) > _UNIT_ROUNDOFF[than]


class WiderArithmetic(TorchDispatchMode):
    """While active, every op that rounds is computed in ``dtype`` (float32 or float64): its
    narrower floating inputs are converted (exactly) for that op alone, and conversions or
    new tensors asked for in a narrower floating dtype are made in ``dtype``. A module whose
    weights stay in a 16-bit dtype then computes what the same module with its weights
    converted to ``dtype`` computes, without a second copy of its weights: only each op's
    operands are widened, while the op runs. Data movement (views, indexing, concatenation)
    is left as it is, so selecting one expert's slice of a stacked weight widens that slice
    alone."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def _up(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and _narrower(value.dtype, self.dtype):
            return value.detach().to(self.dtype)
        return value

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _narrower(kwargs.get("dtype"), self.dtype):
            kwargs = {**kwargs, "dtype": self.dtype}
        if func.overloadpacket.__name__ in FUSED_ATTENTION_OPS:
            args, kwargs = tree_map(self._up, args), tree_map(self._up, kwargs)
            return func(*args, **kwargs)
        if not _may_round(func):
            return func(*args, **kwargs)
        mutable = func._schema.is_mutable
        if mutable and args and isinstance(args[0], torch.Tensor) and _narrower(args[0].dtype, self.dtype):
            # an in-place op on a narrow tensor writes a narrow result: widen the other operands only
            return func(args[0], *tree_map(self._up, args[1:]), **tree_map(self._up, kwargs))
        return func(*tree_map(self._up, args), **tree_map(self._up, kwargs))
