"""Other legitimate algorithms of an op than the one torch's kernel uses, for the perturbed
runs (:mod:`.perturb`) to draw from: fused kernels run as their decompositions, a variance in
one pass, a float16 layer norm computed in float16, a 16-bit matmul with a bias whose product
is rounded before the bias is added, a 16-bit fused attention computed as transformers' eager
attention computes it, a top-k that takes other equal candidates."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .sums import sequential_sum_error_std
from .wider import _named_arguments, _widen, causal_seen


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


#: Input dtypes whose layer norm a legitimate kernel may compute in that dtype itself: its mean,
#: variance, 1/std, normalised values, scale and shift each rounded to it, so the row's
#: statistics carry a float16 rounding error shared by the whole row. XLA lowers a layer
#: norm to a batch norm in the operand's type, which it expands to one-pass statistics
#: (E[x^2] - E[x]^2) summed in that type. torch-xla's CPU float16 LayerNorm, each row's scale
#: error in float16 units of 2^-11 (sd over 4096 rows; bench/README.md): 0.77 on rows of 64
#: centred values (eager 0.09), 3.8 on rows of 128 of mean 2 and sd 1 (eager 0.07), where
#: these statistics summed pairwise in float16 give 0.63 and 3.6, and a two-pass variance
#: 0.5 and 0.5. Its bfloat16 one takes its statistics in float32 (XLA's CPU backend widens
#: bfloat16 reductions) and rounds the normalised values, the scale and the shift each to
#: bfloat16: so on all but 3 in 10^5 elements of rows of 1024 (random, with a shared offset,
#: with outlier channels; ``tests/unit/test_xla_ops.py``), 1.7-1.9 times eager's error, and
#: leaning along the output where a single rounding does not (``bench/README.md``).
OWN_DTYPE_NORMS = frozenset({torch.float16, torch.bfloat16})
#: Of those, the dtypes whose statistics such a layer norm takes in float32 (no kernel sums in
#: bfloat16, as for the matmuls' accumulation); the steps after them are then rounded as XLA
#: rounds them too, not perturbed (perturbed, a post-norm layer's runs erred 2.9 times one
#: rounding where torch-xla errs 1.7-1.9, and a wrong norm epsilon passed).
WIDE_STATISTICS_NORMS = frozenset({torch.bfloat16})
#: How far such a layer norm may lean beyond what its float16 statistics give: a run that
#: computes them in float16 scales all the rows of each norm call by one factor 1 + s * 2^-11,
#: s drawn from U(-OWN_DTYPE_NORM_LEAN, OWN_DTYPE_NORM_LEAN) for the call and run (a kernel's
#: lean over a call's rows; which way depends on the rows: torch-xla leaned on BERT's two
#: norms of one layer in opposite directions). torch-xla's CPU float16 LayerNorm on random
#: rows (``bench/bench_norm_lean.py``; widths 64, 96, 512, 768, 1024, 2560 and 4544; means
#: 0, 0.5 and 2 times the spread; 2048 rows each) leans -0.06 to +0.17 units beyond these
#: statistics (at most 0.38 with pairwise sums, 0.96 with 1/count exact and a correctly
#: rounded rsqrt), from which the range is set; widths held out (192 to 8192) read -0.09 to
#: +0.13 (bench/README.md).
OWN_DTYPE_NORM_LEAN = 0.2


def _pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over ``x``'s last dimension by halves, each partial sum in ``x``'s dtype (an
    odd element out carried to the next level)."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        pairs = x[..., :half] + x[..., half : 2 * half]
        x = torch.cat((pairs, x[..., 2 * half :]), dim=-1) if x.shape[-1] % 2 else pairs
    return x[..., 0]


#: XLA's CPU backend sums a float16 row in windows of this many elements, level by level.
XLA_REDUCE_WINDOW = 32


def _windowed_sum(x: torch.Tensor, one_by_one: bool) -> torch.Tensor:
    """The sum over ``x``'s last dimension in the order XLA's CPU backend sums a float16 row,
    each partial sum in ``x``'s dtype: windows of ``XLA_REDUCE_WINDOW`` (the row padded with
    zeros at both ends to a multiple), each as 16 lanes of two elements, the lanes by halves;
    the windows' sums likewise, level by level, until 32 or fewer are left, which are added
    as 16 lanes by halves or (``one_by_one``: its fused sum of squares) one after another.
    Rows of 64, 512 and 1024 then normalise as torch-xla's float16 LayerNorm does, bit for
    bit (1000: 99.6% of rows; 96, 768, 2560, 4544: 80-88%, its order there not all known)."""
    lanes = XLA_REDUCE_WINDOW // 2
    while x.shape[-1] > XLA_REDUCE_WINDOW:
        pad = -x.shape[-1] % XLA_REDUCE_WINDOW
        if pad:
            x = torch.nn.functional.pad(x, (pad // 2, pad - pad // 2))
        windows = x.reshape(*x.shape[:-1], -1, XLA_REDUCE_WINDOW)
        x = _pairwise_sum(windows[..., :lanes] + windows[..., lanes:])
    if not one_by_one:
        if x.shape[-1] > lanes:  # the elements past the lanes added to the first ones
            rest = x.shape[-1] - lanes
            x = torch.cat((x[..., :rest] + x[..., lanes:], x[..., rest:lanes]), dim=-1)
        return _pairwise_sum(x)
    total = x[..., 0]
    for j in range(1, x.shape[-1]):
        total = total + x[..., j]
    return total


def reciprocal_sqrt_rounded_twice(x: torch.Tensor) -> torch.Tensor:
    """1/sqrt(x) as XLA computes a 16-bit rsqrt: a square root and a reciprocal, each rounded
    to ``x``'s dtype, exactly so even under a dispatch mode (a perturbed run's): its error is
    a function of the input, which another rounding drawn per element would not keep."""
    with _disable_current_modes():
        root = torch.sqrt(x.float()).to(x.dtype)
        return torch.reciprocal(root.float()).to(x.dtype)


def _statistics(rows: torch.Tensor, count: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and 1/std of each row as XLA's float16 batch-norm expansion computes them
    (:func:`layer_norm_in_own_dtype`); a row whose sums pass the dtype's range (float16: a
    row of 2048 whose rms is 6 reaches 65504) takes them from float32 sums, as a kernel that
    sums wider: an overflow is no rounding."""
    inverse = torch.tensor(1.0 / count, dtype=rows.dtype, device=rows.device)
    mean = _windowed_sum(rows, False) * inverse
    square = _windowed_sum(rows * rows, True) * inverse
    var = (square - mean * mean).clamp_min(0)
    rstd = reciprocal_sqrt_rounded_twice(var + torch.tensor(eps, dtype=rows.dtype, device=rows.device))
    overflow = ~(torch.isfinite(mean) & torch.isfinite(square))
    if bool(overflow.any()):
        wide = rows.float()
        mean = torch.where(overflow, wide.mean(-1).to(rows.dtype), mean)
        rstd = torch.where(overflow, torch.rsqrt(wide.var(-1, unbiased=False) + eps).to(rows.dtype), rstd)
    return mean, rstd


def _scaled_and_shifted(out: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """A layer norm's normalised values times its weight plus its bias, each op's result in
    ``out``'s dtype."""
    out = out if weight is None else out * weight
    return out if bias is None else out + bias


def layer_norm_in_own_dtype(
    x: torch.Tensor,
    normalized_shape: Any,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    lean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``native_layer_norm`` computed in ``x``'s dtype as XLA's batch-norm expansion computes
    it. For a dtype of ``WIDE_STATISTICS_NORMS``: its statistics in float32, the normalised
    values, scale and shift each rounded to the dtype, all as XLA rounds them even under a
    perturbed run. Else: the mean and E[x^2] each summed in that dtype in XLA's order
    (:func:`_windowed_sum`) and multiplied by 1/count rounded to it (not exact where count is
    not a power of two), the variance their difference (at least 0), then 1/std as a square
    root and a reciprocal each rounded to the dtype (XLA's 16-bit rsqrt: bit for bit on 99.95%
    of float16 inputs, a quarter of them one ulp off the correctly rounded result); the
    normalised values, the scale and the shift, each op's result in that dtype. The statistics are computed as XLA
    rounds them even under :class:`.perturb.PerturbedArithmetic` (only what follows them is
    perturbed): their errors are a function of the rows, so rows that share a variance or a
    layout of large channels lean together by them (up to 0.6 float16 units from the rsqrt
    where the variances lie within 1%), which drawing each row's rounding apart would
    average away. A row whose sums pass the dtype's range takes its statistics from float32
    sums. ``lean`` (float32, broadcast over the rows): each row's normalised values scaled
    by ``1 + lean`` before they are rounded (a kernel that leans, ``OWN_DTYPE_NORM_LEAN``).
    The returned mean and 1/std take the dtypes torch's own decomposition gives them."""
    count = math.prod(int(size) for size in normalized_shape)
    rows = x.reshape(*x.shape[: x.dim() - len(normalized_shape)], count)
    wide = x.dtype in WIDE_STATISTICS_NORMS
    with _disable_current_modes():  # XLA's statistics as it rounds them, in every run
        if wide:
            var, mean = torch.var_mean(rows.float(), -1, correction=0)
            rstd = torch.rsqrt(var + eps)
        else:
            mean, rstd = _statistics(rows, count, eps)
    mean = mean.reshape(*rows.shape[:-1], *([1] * len(normalized_shape)))
    rstd = rstd.reshape(mean.shape)
    if wide:  # normalised in float32, then scaled and shifted, each rounded as XLA rounds it
        with _disable_current_modes():
            scale = rstd if lean is None else rstd * (1 + lean)
            out = _scaled_and_shifted(((x.float() - mean) * scale).to(x.dtype), weight, bias)
    else:
        out = (x - mean) * rstd if lean is None else ((x - mean).float() * rstd.float() * (1 + lean)).to(x.dtype)
        out = _scaled_and_shifted(out, weight, bias)
    stats = x.dtype if x.device.type in ("cpu", "mtia") else torch.float32
    return out, mean.to(stats), rstd.to(stats)


def one_pass_var_mean(
    x: torch.Tensor, dim: Any = None, *, correction: Any = None, keepdim: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.var_mean`` the way one-pass kernels compute it (fused norms that accumulate the
    sum and the sum of squares together): E[x^2] - E[x]^2, rescaled for the correction. The
    other legitimate variance algorithm beside the two-pass one torch uses; its cancellation
    error is larger where a row's mean is large against its spread."""
    dims = list(range(x.dim())) if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    dims = [d % max(x.dim(), 1) for d in dims]
    count = math.prod(x.shape[d] for d in dims)
    mean = torch.mean(x, dims, keepdim=True)
    var = (torch.mean(x * x, dims, keepdim=True) - mean * mean).clamp_min(0)
    c = 1 if correction is None else float(correction)
    if c:
        var = var * (count / max(count - c, 1))
    if not keepdim:
        var, mean = var.squeeze(dims), mean.squeeze(dims)
    return var, mean


#: Dtypes whose matmul with a bias (``addmm``, a linear layer) a legitimate implementation may
#: compute as a product rounded to the dtype and a bias added to it (two roundings), as XLA
#: lowers a linear layer (a dot, then an add): torch-xla's CPU bfloat16 linear measured a mean
#: error of 0.44 ulp against eager's 0.25 and a lean of -0.04 ulp against the result's sign
#: (eager +0.01), which over a layer's output adds up to several noise units
#: (bench/README.md).
PRODUCT_ROUNDED_ADDMM = frozenset({torch.bfloat16, torch.float16})


def addmm_product(mat1: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    """``mat1 @ mat2`` of 16-bit operands computed in float32 (their products exact, summed
    in float32) and rounded to nearest in their dtype: a kernel's product."""
    return torch.mm(mat1.float(), mat2.float()).to(mat1.dtype)


#: Dtypes whose fused attention (``scaled_dot_product_attention``'s kernels, which hold the scores
#: and the probabilities in float32) a legitimate port may compute as transformers' eager
#: attention does: the scores and the probabilities each rounded to the dtype, the softmax in
#: float32 between. On a sharp attention that rounding is most of the layer's error: a trained
#: Gemma 3 270M's eager-attention layer read noise_ratio 1.96 in bfloat16 where the fused
#: kernel's runs reached 1.44, Qwen2.5-Coder-0.5B's 1.95 and 1.8 where they reached 1.51 and
#: 1.34. In float32 both keep float32 (a decomposition there erred 0.24 times torch-xla's kernel).
EAGER_ATTENTION = frozenset({torch.bfloat16, torch.float16})


def _attention_call(
    func: Any, args: tuple, kwargs: dict, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, float, bool]:
    """The query, keys (grouped heads repeated), values and mask of the fused attention op
    ``func`` on ``args``, ``kwargs`` for the batch rows ``rows``, with its scale and whether it
    is causal."""
    named = _named_arguments(func, args, kwargs)
    query, key, value = (named[n] for n in ("query", "key", "value"))
    batch = query.shape[0]
    query, key, value = (t[rows] if t.shape[0] == batch else t for t in (query, key, value))
    if key.shape[-3] != query.shape[-3]:  # grouped key and value heads
        key, value = (t.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3) for t in (key, value))
    mask = named.get("attn_mask", named.get("attn_bias"))
    if mask is not None and mask.dim() == query.dim() and mask.shape[0] == batch:
        mask = mask[rows]
    scale = named.get("scale") or 1.0 / math.sqrt(query.shape[-1])
    return query, key, value, mask, scale, bool(named.get("is_causal", False))


def _masked(scores: torch.Tensor, mask: Any, causal: bool) -> torch.Tensor:
    """``scores`` with the op's mask applied (a boolean one hides, another adds) and, for a
    causal call, the keys after each query hidden (top-left aligned, as the op's ``is_causal``)."""
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if causal:
        length, source = scores.shape[-2:]
        scores = scores.masked_fill(~causal_seen(0, length, source, scores.device), float("-inf"))
    return scores


def eager_attention(func: Any, args: tuple, kwargs: dict, rows: torch.Tensor) -> torch.Tensor | None:
    """The output of the fused attention op ``func`` on ``args``, ``kwargs`` for the batch rows
    ``rows`` (indices into the query's first dimension), computed as transformers' eager
    attention computes it: ``softmax((q @ k^T) * scale + mask, float32)`` rounded to the
    dtype, times the values; a causal call's queries top-left aligned (query i sees keys 0 to
    i), as the op's ``is_causal``; grouped key heads repeated. None where it overflows (an overflow
    is no rounding: those rows keep the fused kernel's result)."""
    query, key, value, mask, scale, causal = _attention_call(func, args, kwargs, rows)
    scores = _masked(torch.matmul(query, key.transpose(-2, -1)) * scale, mask, causal)
    out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype), value)
    return out if bool(torch.isfinite(out).all()) else None


def in_order_scores_attention(
    func: Any, args: tuple, kwargs: dict, rows: torch.Tensor, generator: torch.Generator
) -> torch.Tensor | None:
    """The output of the float32 fused attention op ``func`` on ``args``, ``kwargs`` for the
    batch rows ``rows`` (indices into the query's first dimension), as XLA's CPU backend lowers
    a one-query (decode-step) attention: each score, a sum over the head's dimension, summed in
    order (its error drawn at that sum's size, :func:`.sums.sequential_sum_error_std`), the
    rest computed wider and rounded once. Its scores err 1.5-1.9 times eager's (as an in-order
    sum does; ``bench/bench_xla_kernels.py --one-row``), and a sharp softmax carries that to
    the output (Gemma 3 270M's layer 11 over 601 keys: 6.5 times eager's error). None where it
    overflows."""
    query, key, value, mask, scale, causal = _attention_call(func, args, kwargs, rows)
    keys = key.transpose(-2, -1)
    error = sequential_sum_error_std(query, keys, query.dtype)
    error *= torch.randn(error.shape, generator=generator, dtype=error.dtype, device=error.device)
    scores = _masked((_widen(query) @ _widen(keys) + error) * scale, _widen(mask), causal)
    out = (torch.softmax(scores, dim=-1) @ _widen(value)).to(query.dtype)
    return out if bool(torch.isfinite(out).all()) else None


def topk_ties_broken(func: Any, args: tuple, kwargs: dict, generator: torch.Generator) -> Any:
    """``topk`` with exact ties among its candidates broken in an order drawn from
    ``generator``: the candidates are shuffled along the dimension, chosen from, and mapped
    back (the same values; which of equal candidates comes first is drawn)."""
    named = _named_arguments(func, args, kwargs)
    x, dim = named["self"], named.get("dim", -1)
    if x.dim() == 0 or x.numel() == 0:
        return func(*args, **kwargs)
    order = torch.rand(x.shape, generator=generator, device=x.device).argsort(dim=dim)
    values, picked = func(x.gather(dim, order), named["k"], dim, named.get("largest", True), named.get("sorted", True))
    return values, order.gather(dim, picked)
