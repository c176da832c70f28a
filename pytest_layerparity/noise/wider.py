"""Ops computed one precision wider: a large matmul's weight widened a block of its columns
at a time (:func:`widened_matmul`), a fused attention's wider result computed by the math
attention (:func:`attention_reference`), and :class:`WiderArithmetic`, every op of a module
that rounds computed in a wider dtype (the precision floor's pass)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from .rounding import _UNIT_ROUNDOFF, _WIDER, _may_round
from .tokens import write_block


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


#: Matmuls whose float32 result of 16-bit operands is taken at a 16-bit speed
#: (:func:`exact_fast_matmul`).
_FAST_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm"})

#: Per device type: the float32 matmul precision setting that computes a float32 matmul with
#: 16-bit arithmetic, and the operand dtypes whose every value that arithmetic holds exactly.
#: On CUDA, TF32 (float32's exponent, an 11-bit significand: bfloat16's and float16's values
#: exactly); on the CPU, oneDNN's bfloat16 mode (bfloat16's values alone).
_FAST_PRECISION = {
    "cuda": ("cuda", "tf32", frozenset({torch.bfloat16, torch.float16})),
    "cpu": ("mkldnn", "bf16", frozenset({torch.bfloat16})),
}


@contextmanager
def exact_fast_matmul(func: Any, args: tuple, kwargs: dict) -> Iterator[None]:
    """While active, float32 matmuls run in 16-bit arithmetic where ``func`` is a matmul whose
    floating operands are all of a dtype that arithmetic holds exactly (``_FAST_PRECISION``),
    on one device type: the products are then exact and summed in float32, so the widened
    operands' float32 result is the float32 one (another summation order) at the 16-bit
    units' speed (an H100's tensor cores: about 7x its float32 rate; this project's CPU
    machines: a 1536 x 1024 x 4096 product 2.8x faster). Elsewhere (float32 operands,
    which the 16-bit arithmetic would round; a torch without the setting) nothing changes."""
    backend = _fast_backend(func, (*args, *kwargs.values()))
    if backend is None:
        yield
        return
    setting, value = backend
    before = setting.fp32_precision
    setting.fp32_precision = value
    try:
        yield
    finally:
        setting.fp32_precision = before


def _fast_backend(func: Any, values: tuple) -> tuple[Any, str] | None:
    """(the precision setting, its fast value) for this matmul's operands, or None."""
    if func.overloadpacket.__name__ not in _FAST_MATMULS:
        return None
    floating = [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]
    kinds = {v.device.type for v in floating}
    if len(kinds) != 1 or (kind := kinds.pop()) not in _FAST_PRECISION:
        return None
    module, value, exact = _FAST_PRECISION[kind]
    setting = getattr(getattr(torch.backends, module, None), "matmul", None)
    if setting is None or not hasattr(setting, "fp32_precision") or any(v.dtype not in exact for v in floating):
        return None
    return setting, value


# Fused attention kernels (what scaled_dot_product_attention dispatches to). Called with wider
# inputs, some refuse and some (cuDNN's) return wrong values instead: their wider result is
# computed with the math attention instead (see attention_reference), but for
# WIDENED_ATTENTION_OPS.
FUSED_ATTENTION_OPS = frozenset(
    {
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    }
)


#: Fused attention kernels whose result on widened inputs is the wider result: the CPU flash
#: kernel takes float32 and float64 and holds no scores. Against the blocked math attention,
#: on 16 heads of 512 causal queries of 64 (bfloat16 operands, float32 wide): 6.0 ms vs 12.2,
#: at 2048 queries 59 vs 217 ms, the same error against float64 (2.4 and 2.3 float32 ulps of
#: the largest output).
WIDENED_ATTENTION_OPS = frozenset({"_scaled_dot_product_flash_attention_for_cpu"})


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
        if causal:
            seen = causal_seen(start, stop, source, query.device)
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


def causal_seen(start: int, stop: int, keys: int, device: torch.device) -> torch.Tensor:
    """Which of ``keys`` keys each of the queries ``start`` to ``stop`` sees in a causal fused
    attention, top-left aligned as the op's ``is_causal``: query i sees keys 0 to i (a boolean
    [stop - start, keys])."""
    return torch.arange(keys, device=device) <= torch.arange(start, stop, device=device)[:, None]


def with_rows(result: Any, rows: torch.Tensor, values: torch.Tensor) -> Any:
    """``result`` of a fused attention op (its output first, or the output alone) with the
    output's rows ``rows`` (indices into its first dimension) replaced by ``values``."""
    first = result[0] if isinstance(result, tuple) else result
    output = first.index_copy(0, rows, values.to(first.dtype))
    return (output, *result[1:]) if isinstance(result, tuple) else output


def query_block(length: int, head_dim: int, source: int) -> int:
    """Queries per block of the math attention over ``length`` queries and ``source`` keys: a
    block's scores (heads x rows x keys) about the size of all the queries (heads x length x
    head_dim), at least one row."""
    return max(1, length * head_dim // max(source, 1))


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


def _default_float_fill(func: Any, args: tuple, kwargs: dict) -> bool:
    """A ``full`` with a float fill value and no dtype: a new tensor of the default dtype."""
    return (
        func.overloadpacket.__name__ == "full"
        and kwargs.get("dtype") is None
        and len(args) > 1
        and isinstance(args[1], float)
    )


class WiderArithmetic(TorchDispatchMode):
    """While active, every op that rounds is computed in ``dtype`` (float32 or float64): its
    narrower floating inputs are converted (exactly) for that op alone, and conversions or
    new tensors asked for in a narrower floating dtype (or filled with a float in the default
    one) are made in ``dtype``. A module whose
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
        elif _default_float_fill(func, args, kwargs) and _narrower(torch.get_default_dtype(), self.dtype):
            # torch.full(shape, finfo(x.dtype).min) with no dtype (XGLM's mask): a value read
            # from a widened tensor, which the narrower default dtype cannot hold
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
