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
  half an ulp and rounded to nearest: at ``error_scale`` 1 an elementwise result is off by up
  to 1.5 ulp (about half an ulp on average), the range of kernels that are not correctly
  rounded (vendor math libraries allow 1 to 2 ulp for exp, erf, rsqrt) rather than the half
  ulp of correct rounding; the default scale (below) doubles both parts. See
  :func:`another_rounding`.
* ``"stochastic"`` (Verificarlo's and Verrou's stochastic rounding): the same, with the point
  rounded up or down at random, each neighbour with probability in proportion to its
  closeness (unbiased, correctly-rounded-sized errors: a weaker null).
* ``"random"`` (CADNA's and Verrou's random rounding on the result as computed): the result
  is multiplied by ``1 + u * e`` with ``e`` drawn per element from U(-1, 1), ``u`` the unit
  roundoff of the output's dtype, plus ``u * s`` with ``s`` drawn once per op from
  U(-systematic, systematic) (a consistent sub-ulp bias over a whole result), and rounded back.

Ops that move data without rounding (views, copies, indexing, concatenation, comparisons,
max/min, integer results) are left exact.

What a run models beyond rounding each op another way (all three answer the same question:
which results a correct port's kernels legitimately give):

* every float32 (or float64) result's error is ``ERROR_SCALE`` (2) times the reference
  kernel's, reflected at random: kernels less accurate than the reference's but within what
  math libraries document (1 to 2 ulp), summations in another order or blocking, a compiler
  that rounds intermediates eager did not (torch-xla's float32 BERT layer measures 1.27 times
  the eager error; see bench/README.md). A 16-bit result keeps scale 1: kernels compute it in
  float32 and round once, so its error is that rounding whatever the kernel's accuracy;
* fused norms and softmax (``DECOMPOSED_OPS``) run as their decompositions, so their mean,
  variance and sum are perturbed on their own and their error is shared by the whole row;
* a variance is computed half the time in one pass (E[x^2] - E[x]^2, ``one_pass_var_mean``),
  as fused norm kernels do, and otherwise as torch does (two passes);
* a float16 matmul (``ACCUMULATING_OPS``) may keep its partial sums in float16
  (``SIXTEEN_BIT_ACCUMULATION``): tensor cores' float16-accumulate mode, cuBLAS's reduced-precision
  reductions (on by default in PyTorch), XLA's CPU backend (its float16 dot measured 12 times
  eager's error: bench/README.md). Its error is drawn at the size of one sequential float16 sum
  of the same products (:func:`sequential_sum_error_std`), the least accurate of the orders such
  kernels use. Not for bfloat16: no kernel sums in bfloat16 (8 significant bits).

With ``break_ties``, a run also breaks exact ties among ``topk``'s candidates in an order of
its own (the values are the same; which of equal candidates it takes is drawn per call): a
router's or a sparse-attention indexer's choice among equal scores (DeepSeek-V3.2's indexer
scores many keys exactly 0) is the implementation's, and another backend's top-k takes
others. The layer tests judge such choices one router at a time (a flip between equal scores
is a near tie); the whole model's envelope runs with it, so that what follows another choice
among equals in the next layers and in the logits is within what the runs reach.

Each run under a new seed is one legitimate implementation of the same layer: the spread of
a statistic over runs is what a correct port's statistic is judged against.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .tokens import write_block

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
#: How much less accurate than the reference's kernels a legitimate run's are: each op's error
#: twice the reference kernel's (vendor math libraries document 1 to 2 ulp for exp, erf,
#: rsqrt; a blocked or sequential summation against the reference's pairwise one; a compiler
#: that fuses, reassociates and rounds intermediates where eager did not).
ERROR_SCALE = 2.0
#: Result dtypes whose matmuls a legitimate kernel may accumulate in the result's own dtype.
SIXTEEN_BIT_ACCUMULATION = frozenset({torch.float16})
#: Matmul ops, by packet name, with the positions of their two factors (m x k and k x n).
ACCUMULATING_OPS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2)}
#: Checkpoints along the summed dimension at which the partial sums are computed exactly.
_CHECKPOINTS = 8


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
    draw = torch.rand(exact.shape, generator=generator, dtype=exact.dtype, device=exact.device)
    take = draw < p_other
    del draw, p_other
    take &= torch.isfinite(other)
    take &= back != exact
    del back
    return torch.where(take, other, nearest)


#: Elements another_rounding works on at once (on the CPU): its wide temporaries (the error,
#: the point reached, the rounding's draws) are a block's, not several copies of the result.
ROUNDING_BLOCK = 1 << 20


def another_rounding(
    result: torch.Tensor, wide: torch.Tensor, generator: torch.Generator, jitter: bool = False, scale: float = 1.0
) -> torch.Tensor:
    """Another legitimate value of an op's ``result``, given the op computed one precision
    wider (``wide``): per element, the result's error against ``wide`` is kept or reflected
    (at random, half and half), and the point reached is rounded stochastically.

    For an elementwise op (``result`` is ``wide`` rounded to nearest) this is exactly
    stochastic rounding of ``wide``. For a reduction (a matmul or a sum accumulated in the
    result's dtype) it keeps the size of the accumulation error while drawing its sign anew,
    as another reduction order would; recomputing wider alone would drop that error and
    make every run more accurate than the golden. ``scale`` multiplies both errors: a kernel
    that is that many times less accurate than the reference's.

    On the CPU a result of more than ``ROUNDING_BLOCK`` elements is worked through in blocks
    with the same draws as the whole: the signs are the generator's next n draws and the
    rounding's the n after them (a second generator starts where the signs end; the
    generator is left where the whole would leave it)."""
    n = wide.numel()
    if wide.device.type != "cpu" or n <= ROUNDING_BLOCK:
        return _another_rounding(result, wide, generator, generator, jitter, scale)
    draws = torch.Generator(device=wide.device)
    draws.set_state(generator.get_state())
    for start in range(0, n, ROUNDING_BLOCK):  # past the signs' draws
        torch.randint(0, 2, (min(ROUNDING_BLOCK, n - start),), generator=draws, dtype=wide.dtype)
    out = torch.empty(wide.shape, dtype=result.dtype, device=wide.device)
    flat_out, flat_result, flat_wide = out.view(-1), result.reshape(-1), wide.reshape(-1)
    for start in range(0, n, ROUNDING_BLOCK):
        stop = min(start + ROUNDING_BLOCK, n)
        part = _another_rounding(flat_result[start:stop], flat_wide[start:stop], generator, draws, jitter, scale)
        flat_out[start:stop] = part
        del part
    generator.set_state(draws.get_state())
    return out


def _another_rounding(
    result: torch.Tensor,
    wide: torch.Tensor,
    signs: torch.Generator,
    draws: torch.Generator,
    jitter: bool,
    scale: float,
) -> torch.Tensor:
    """:func:`another_rounding` of one block: its signs from ``signs``, its rounding's
    draws from ``draws``."""
    error = result.to(wide.dtype).sub_(wide)
    # the sign drawn in the wide dtype: the same draws as in int64 (tested), a quarter of the bytes
    point = torch.randint(0, 2, wide.shape, generator=signs, device=wide.device, dtype=wide.dtype)
    point.mul_(2).sub_(1).mul_(error).mul_(scale).add_(wide)  # wide + sign * error * scale
    finite = torch.isfinite(error)
    del error
    point = torch.where(finite, point, wide)
    del finite
    if jitter:  # anywhere within half an ulp (times scale) of the point, then to nearest
        u = _UNIT_ROUNDOFF[result.dtype] * scale
        factor = torch.rand(wide.shape, generator=draws, dtype=wide.dtype, device=wide.device)
        factor.mul_(2).sub_(1).mul_(u).add_(1)  # 1 + u * (2 rand - 1)
        return point.mul_(factor).to(result.dtype)
    return stochastic_round(point, result.dtype, draws)


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


def _widen(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in _WIDER:
        return value.detach().to(_WIDER[value.dtype])
    return value


#: Elements of a matmul's second operand (a weight) widened at once: a larger one is worked
#: through in blocks of its columns, each widened for its part of the result alone (the
#: wider copy of a 4096 x 1536 projection is 25 MB in float32, 50 MB in float64).
WIDEN_BLOCK = 1 << 20

_MATMULS = frozenset({"mm", "addmm"})


def widened_matmul(func: Any, args: tuple, kwargs: dict, widen: Callable[[Any], Any]) -> torch.Tensor | None:
    """``mm(a, b)`` or ``addmm(bias, a, b)`` on operands widened by ``widen``, ``b``'s
    columns (and the bias's) widened one block at a time when ``b`` has more than
    ``WIDEN_BLOCK`` elements; None for another op or a smaller ``b`` (widen it whole)."""
    if func.overloadpacket.__name__ not in _MATMULS or len(args) < 2:
        return None
    b = args[-1]
    if not isinstance(b, torch.Tensor) or b.dim() != 2 or b.numel() <= WIDEN_BLOCK:
        return None
    column = b.narrow(1, 0, 1)
    if widen(column) is column:  # not widened: left to the op as it is
        return None
    columns = b.shape[1]
    step = max(1, WIDEN_BLOCK // max(1, b.shape[0]))
    a, bias, extra = widen(args[-2]), (args[0] if len(args) == 3 else None), tree_map(widen, kwargs)
    out = None
    for start in range(0, columns, step):
        width = min(step, columns - start)
        block = [a, widen(b.narrow(1, start, width))]
        if bias is not None:
            sliced = bias.narrow(-1, start, width) if bias.dim() and bias.shape[-1] == columns else bias
            block.insert(0, widen(sliced))
        part = func(*block, **extra)
        out = write_block(out, part, -1, start, columns)
        del part, block
    return out


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


def _named_arguments(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """An op's arguments by their names in its schema."""
    named = dict(kwargs)
    for argument, value in zip(func._schema.arguments, args, strict=False):
        named[argument.name] = value
    return named


def attention_reference(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """The attention output of a fused attention op (``func`` called with ``args`` and
    ``kwargs``), computed one precision wider by the math attention: the reference its first
    result is perturbed around. Arguments are read by name from the op's schema. The queries
    go through in blocks (:func:`query_block`), so the scores held at once are about the size
    of the queries themselves, not batch x heads x seq x seq; each block's output is written
    into one output as it comes (:func:`tokens.write_block`)."""
    named = _named_arguments(func, args, kwargs)
    query, key, value = (_widen(named[n]) for n in ("query", "key", "value"))
    mask = _widen(named.get("attn_mask", named.get("attn_bias")))
    causal = bool(named.get("is_causal", False))
    length, source = query.shape[-2], key.shape[-2]
    step = query_block(length, query.shape[-1], source)
    out = None
    for start in range(0, length, step):
        stop = min(start + step, length)
        rows = mask[..., start:stop, :] if mask is not None and mask.shape[-2] == length else mask
        if causal:  # top-left aligned, as the op's is_causal: query i sees keys 0..i
            seen = torch.arange(source, device=query.device) <= torch.arange(start, stop, device=query.device)[:, None]
            # additive, as the op takes its mask (the front end turns a boolean one into this)
            hidden = torch.zeros(seen.shape, dtype=query.dtype, device=query.device).masked_fill(~seen, float("-inf"))
            rows = hidden if rows is None else rows + hidden
        output, _ = torch.ops.aten._scaled_dot_product_attention_math(
            query[..., start:stop, :],
            key,
            value,
            rows,
            0.0,
            False,
            scale=named.get("scale"),
            enable_gqa=query.shape[-3] != key.shape[-3],
        )
        if step >= length:
            return output
        out = write_block(out, output, -2, start, length)
        del output
    return out


def query_block(length: int, head_dim: int, source: int) -> int:
    """Queries per block of the math attention over ``length`` queries and ``source`` keys: a
    block's scores (heads x rows x keys) about the size of all the queries (heads x length x
    head_dim), at least one row."""
    return max(1, length * head_dim // max(source, 1))


def _decomposed_ops() -> dict[Any, Any]:
    """Composite kernels whose per-row reductions (a norm's mean and variance, a softmax's sum)
    a legitimate implementation computes its own way: under the perturbation they run as
    their decomposition, so each reduction is perturbed on its own and its error is shared by
    the whole row, as another kernel's (another rsqrt, another summation order) would be.
    Perturbing only the fused kernel's output would give each element an independent error
    and miss that coherent part."""
    from torch._decomp import decomposition_table

    aten = torch.ops.aten
    ops = (
        aten.native_layer_norm.default,
        aten.native_group_norm.default,
        aten._softmax.default,
        aten._log_softmax.default,
    )
    return {op: decomposition_table[op] for op in ops if op in decomposition_table}


DECOMPOSED_OPS = _decomposed_ops()
VARIANCE_OPS = frozenset({torch.ops.aten.var_mean, torch.ops.aten.var})


def one_pass_var_mean(
    x: torch.Tensor, dim: Any = None, *, correction: Any = None, keepdim: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.var_mean`` the way one-pass kernels compute it (fused norms that accumulate the
    sum and the sum of squares together): E[x^2] - E[x]^2, rescaled for the correction. The
    other legitimate variance algorithm beside the two-pass one torch uses; its cancellation
    error is larger where a row's mean is large against its spread."""
    dims = list(range(x.dim())) if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    dims = [d % max(x.dim(), 1) for d in dims]
    count = 1
    for d in dims:
        count *= x.shape[d]
    mean = torch.mean(x, dims, keepdim=True)
    var = (torch.mean(x * x, dims, keepdim=True) - mean * mean).clamp_min(0)
    c = 1 if correction is None else float(correction)
    if c:
        var = var * (count / max(count - c, 1))
    if not keepdim:
        var, mean = var.squeeze(dims), mean.squeeze(dims)
    return var, mean


#: Perturbed runs of a short call go through the layer (or the model) together, as the
#: samples of one batch of up to this many tokens: a short call's work is mostly each op's
#: overhead, paid once for all of them (the embedded model's 32-token prompt: 12 runs in
#: one). A long one runs alone, as its memory was planned.
BATCHED_TOKENS = 512


def samples_per_forward(samples: int, tokens: int) -> int:
    """How many of ``samples`` perturbed runs of a call of ``tokens`` tokens go together."""
    return max(1, min(samples, BATCHED_TOKENS // max(tokens, 1)))


class PerturbedArithmetic(TorchDispatchMode):
    """While active, rounded floating-point results are rounded another legitimate way (see
    the module's docstring for the two ``mode``s). ``systematic`` scales the per-op bias of
    the random mode. ``error_scale`` multiplies the error of every float32 or float64 result
    in the other modes (how much less accurate than the reference's kernels this run's are;
    default ERROR_SCALE; 16-bit results keep 1). ``ops`` counts the results perturbed."""

    def __init__(
        self,
        seed: int,
        mode: str = "jitter",
        systematic: float = 0.0,
        error_scale: float | None = None,
        samples: int = 1,
        break_ties: bool = False,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"unknown perturbation mode {mode!r}; choose one of {', '.join(MODES)}")
        self.seed = seed
        self.samples = samples  # runs stacked along the first dim, each its own legitimate run
        self.mode = mode
        self.systematic = systematic
        self.error_scale = ERROR_SCALE if error_scale is None else error_scale
        self.break_ties = break_ties
        self.ops = 0
        self._generators: dict[torch.device, torch.Generator] = {}
        self._tie_generators: dict[torch.device, torch.Generator] = {}  # the arithmetic's draws stay as they were

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

    def _scale(self, dtype: torch.dtype) -> float:
        """The error scale of a result in ``dtype``: ``error_scale`` for float32 and float64
        results; 1 for 16-bit ones, which kernels compute in float32 and round once, so their
        error is that rounding whatever the kernel's own accuracy."""
        return self.error_scale if _UNIT_ROUNDOFF.get(dtype, 1.0) <= _UNIT_ROUNDOFF[torch.float32] else 1.0

    def _topk_ties_broken(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``topk`` with exact ties among its candidates broken in a random order of this
        run's: the candidates are shuffled along the dimension, chosen from, and mapped back
        (the same values; which of equal candidates comes first is drawn)."""
        named = _named_arguments(func, args, kwargs)
        x, dim = named["self"], named.get("dim", -1)
        if x.dim() == 0 or x.numel() == 0:
            return func(*args, **kwargs)
        if x.device not in self._tie_generators:
            self._tie_generators[x.device] = torch.Generator(device=x.device).manual_seed(self.seed)
        draw = torch.rand(x.shape, generator=self._tie_generators[x.device], device=x.device)
        order = draw.argsort(dim=dim)
        values, picked = func(
            x.gather(dim, order), named["k"], dim, named.get("largest", True), named.get("sorted", True)
        )
        return values, order.gather(dim, picked)

    def _one_pass(self, x: torch.Tensor) -> bool:
        """Whether this variance runs in one pass (half the time, drawn per op)."""
        if self.mode == "random" or not x.is_floating_point():
            return False
        return torch.rand((), generator=self._generator(x.device)).item() < 0.5

    def _variance(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A variance, in one pass or two: drawn per op, and where runs are stacked
        (``samples``) per run, each run's rows computed its own way."""
        x = args[0]
        if self.samples == 1 or self.mode == "random" or not x.is_floating_point() or x.dim() == 0:
            if self._one_pass(x):
                return self._one_pass_variance(func, args, kwargs)
            return self._perturbed(func, args, kwargs)
        one_pass = torch.rand(self.samples, generator=self._generator(x.device), device=x.device) < 0.5
        if bool(one_pass.all()):
            return self._one_pass_variance(func, args, kwargs)
        two = self._perturbed(func, args, kwargs)
        rows = x.shape[0]
        first = two[0] if isinstance(two, tuple) else two
        if not one_pass.any() or rows % self.samples or first.dim() == 0 or first.shape[0] != rows:
            return two  # the rows are not the runs' (a variance across them): the op's draw is the runs'
        one = self._one_pass_variance(func, args, kwargs)
        keep = one_pass.repeat_interleave(rows // self.samples).view(rows, *([1] * (first.dim() - 1)))
        if isinstance(two, tuple):
            return tuple(torch.where(keep, a, b) for a, b in zip(one, two, strict=True))
        return torch.where(keep, one, two)

    def _one_pass_variance(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``var`` or ``var_mean`` (any overload) computed by :func:`one_pass_var_mean`, its
        ops perturbed."""
        named = _named_arguments(func, args, kwargs)
        correction = named.get("correction")
        if "unbiased" in named:
            correction = 1 if named["unbiased"] in (None, True) else 0
        with self:
            var, mean = one_pass_var_mean(
                named["self"], named.get("dim"), correction=correction, keepdim=bool(named.get("keepdim"))
            )
        return (var, mean) if func.overloadpacket is torch.ops.aten.var_mean else var

    @staticmethod
    def _accumulation_error(name: str, args: tuple, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
        """A draw of the error of summing matmul ``name``'s products in ``dtype``
        (Gaussian, the size :func:`sequential_sum_error_std` gives)."""
        first, second = ACCUMULATING_OPS[name]
        std = sequential_sum_error_std(args[first], args[second], dtype)
        return std * torch.randn(std.shape, generator=generator, dtype=std.dtype, device=std.device)

    def _wider_results(self, func: Any, args: tuple, kwargs: dict) -> list[Any] | None:
        """The op's results computed from its inputs widened one step, or None when it
        cannot be (an op that insists on its dtypes)."""
        if func.overloadpacket.__name__ in FUSED_ATTENTION_OPS:
            return [attention_reference(func, args, kwargs)]
        try:
            exact = widened_matmul(func, args, kwargs, _widen)
            if exact is None:
                exact = func(*tree_map(_widen, args), **tree_map(_widen, kwargs))
        except (RuntimeError, TypeError, NotImplementedError):
            return None
        return tree_flatten(exact)[0]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.break_ties and func is torch.ops.aten.topk.default:
            return self._topk_ties_broken(func, args, kwargs)
        decomposition = DECOMPOSED_OPS.get(func)
        if decomposition is not None:
            with self:  # each op of the decomposition dispatches here again
                return decomposition(*args, **kwargs)
        if func.overloadpacket in VARIANCE_OPS:
            return self._variance(func, args, kwargs)
        return self._perturbed(func, args, kwargs)

    def _perturbed(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func`` run, its rounded floating results rounded another legitimate way."""
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
                generator = self._generator(value.device)
                if name in ACCUMULATING_OPS and value.dtype in SIXTEEN_BIT_ACCUMULATION:
                    wide = wide + self._accumulation_error(name, args, value.dtype, generator)
                perturbed = another_rounding(value, wide, generator, self.mode == "jitter", self._scale(value.dtype))
            if id(value) in inputs:  # an in-place op: perturb the tensor itself
                value.copy_(perturbed)
                results.append(value)
            else:
                results.append(perturbed)
        return tree_unflatten(results, spec)


def _narrower(dtype: Any, than: torch.dtype) -> bool:
    """Whether ``dtype`` is a floating dtype with less precision than ``than``."""
    return isinstance(dtype, torch.dtype) and _UNIT_ROUNDOFF.get(dtype, 0) > _UNIT_ROUNDOFF[than]


#: Functions that check their operands' dtypes before dispatch (a composite's own check: a
#: convolution's "Input type (double) and bias type (float) should be the same"), so their
#: operands are widened where the function is called, not where its ops run.
CHECKED_BEFORE_DISPATCH = frozenset(
    {torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d}
)


class _WidenCheckedOperands(TorchFunctionMode):
    def __init__(self, up: Callable[[Any], Any]) -> None:
        super().__init__()
        self.up = up

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in CHECKED_BEFORE_DISPATCH:
            args, kwargs = tree_map(self.up, args), tree_map(self.up, kwargs)
        return func(*args, **kwargs)


class WiderArithmetic(TorchDispatchMode):
    """While active, every op that rounds is computed in ``dtype`` (float32 or float64): its
    narrower floating inputs are converted (exactly) for that op alone, and conversions or
    new tensors asked for in a narrower floating dtype are made in ``dtype``. A module whose
    weights stay in a 16-bit dtype then computes what the same module with its weights
    converted to ``dtype`` computes, without a second copy of its weights: only each op's
    operands are widened, while the op runs (a matmul's weight of more than ``WIDEN_BLOCK``
    elements a block of its columns at a time: the same values up to the wider dtype's own
    reduction order). Data movement (views, indexing, concatenation) is left as it is, so
    selecting one expert's slice of a stacked weight widens that slice alone."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def _up(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and _narrower(value.dtype, self.dtype):
            return value.detach().to(self.dtype)
        return value

    def __enter__(self) -> WiderArithmetic:
        self._checked = _WidenCheckedOperands(self._up)
        self._checked.__enter__()  # a convolution's operands: Mamba's causal conv1d, widened as it is called
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._checked.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _narrower(kwargs.get("dtype"), self.dtype):
            kwargs = {**kwargs, "dtype": self.dtype}
        if func.overloadpacket.__name__ in FUSED_ATTENTION_OPS:
            args, kwargs = tree_map(self._up, args), tree_map(self._up, kwargs)
            return func(*args, **kwargs)
        if not _may_round(func):
            return func(*args, **kwargs)
        blocked = widened_matmul(func, args, kwargs, self._up)
        if blocked is not None:
            return blocked
        mutable = func._schema.is_mutable
        if mutable and args and isinstance(args[0], torch.Tensor) and _narrower(args[0].dtype, self.dtype):
            # an in-place op on a narrow tensor writes a narrow result: widen the other operands only
            return func(args[0], *tree_map(self._up, args[1:]), **tree_map(self._up, kwargs))
        return func(*tree_map(self._up, args), **tree_map(self._up, kwargs))
