"""What a layer's ops need on a torch-xla device that they do not elsewhere: the index of an
index-along-a-dimension op made a node of its own, and slices clamped to their dimension.

torch-xla 2.9 aborts the whole process (``F external/xla/xla/shape.h:848] Check failed:
buffer != nullptr``, in native code: no Python exception, no test result) when ``index_add``,
``index_copy``, ``index_fill``, ``index_select`` or ``embedding`` takes its index straight
from an op with several outputs (the indices of ``sort``, ``argsort`` or ``topk``): the
lowering reads the shape of that op's tuple where the index's own shape is meant. JetMoE's
attention experts do exactly that (``zeros.index_add(0, index_sorted_experts, ...)``, the
indices of a sort). A view of the index with its own shape is the same tensor, one node
further, and lowers as any index does; the op computes what it computed (a gather and a sum
of the same values in the same order), so nothing the judge sees changes.

The index is replaced where the op is called (a ``TorchFunctionMode``), not where it is
dispatched: a Python dispatch mode on torch-xla tensors changes what data-dependent ops give
(measured: the eager experts' ``nonzero``/``where`` token selection of MiniMax-M2 picked other
tokens, its layer's output off by 8.9 where it is 0.03 without one).

torch-xla 2.9 also raises on a slice whose start or stop lies before a dimension's start
(``x[-512:]`` of 32 rows: "Value out of range (expected to be in range of [-32, 31], but got
-512)"), where Python and eager torch clamp it to the dimension (all 32 rows). XLNet keeps
its memory so (``curr_out[-mem_len:]``). Such a bound is clamped before the slice is taken:
the same rows as eager.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

#: Each function taking an index, and where: (position, keyword) of the index argument.
INDEX_FUNCTIONS: dict[Any, tuple[int, str]] = {
    **{
        function: (2, "index")
        for name in ("index_add", "index_copy", "index_fill", "index_select")
        for function in (getattr(torch, name), getattr(torch.Tensor, name), getattr(torch.Tensor, name + "_", None))
        if function is not None
    },
    torch.nn.functional.embedding: (0, "input"),
    torch.embedding: (1, "indices"),
}


class XlaIndexing(TorchFunctionMode):
    """While active, an :data:`INDEX_FUNCTIONS` call on a torch-xla index takes a view of the
    index (``index.view(index.shape)``) instead of the index itself, and a slice of a torch-xla
    tensor has its bounds clamped (see the module's docstring). ``taken`` counts the calls it
    changed."""

    def __init__(self) -> None:
        super().__init__()
        self.taken = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and len(args) == 2 and _on_xla(args[0]):
            index = _clamped(args[1], args[0].shape)
            if index is not None:
                args = (args[0], index)
                self.taken += 1
        where = INDEX_FUNCTIONS.get(func)
        if where is not None:
            position, keyword = where
            if position < len(args) and _on_xla(args[position]):
                index = args[position]
                args = (*args[:position], index.view(index.shape), *args[position + 1 :])
                self.taken += 1
            elif _on_xla(kwargs.get(keyword)):
                kwargs = {**kwargs, keyword: kwargs[keyword].view(kwargs[keyword].shape)}
                self.taken += 1
        return func(*args, **kwargs)


def _clamped(index: Any, shape: torch.Size) -> Any:
    """``index`` with each slice bound before its dimension's start clamped to it, as eager
    torch clamps; None where nothing changes (or the index is one this does not read: an
    ellipsis, a new axis, a tensor or a list)."""
    items = index if isinstance(index, tuple) else (index,)
    if len(items) > len(shape) or not all(isinstance(i, (int, slice)) and not isinstance(i, bool) for i in items):
        return None
    out, changed = [], False
    for item, size in zip(items, shape, strict=False):
        kept = item
        if isinstance(item, slice) and (item.step is None or (isinstance(item.step, int) and item.step > 0)):
            bounds = [0 if _before(b, size) else b for b in (item.start, item.stop)]
            if bounds != [item.start, item.stop]:
                kept, changed = slice(bounds[0], bounds[1], item.step), True
        out.append(kept)
    if not changed:
        return None
    return tuple(out) if isinstance(index, tuple) else out[0]


def _before(bound: Any, size: int) -> bool:
    return isinstance(bound, int) and not isinstance(bound, bool) and bound < -size


def _on_xla(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "xla"
