"""Discrete choices inside a layer, recorded: find a layer's routers and record which experts
each token went to (and the scores the choice was made on).

Routers are recognised by what they return, not by architecture: a submodule named like a
router or gate whose output holds a 2-D integer tensor (tokens x top-k, the chosen experts)
and a 2-D float tensor (tokens x experts, the logits), as transformers' ``*TopKRouter``
modules do; a bare linear ``gate`` returning logits is read with top-k taken from the config.
A sparse-attention ``indexer`` (DeepSeek-V3.2's, which picks the keys each query attends to)
returns only the chosen positions ([batch, queries, top-k]); the scores it chose on are the
ones it handed to ``torch.topk``. Leading dimensions are flattened: one row per token.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_NAME_HINTS = ("router", "gate", "indexer")


def looks_like_router(name: str, module: torch.nn.Module) -> bool:
    leaf = name.rsplit(".", 1)[-1].lower()
    cls = type(module).__name__.lower()
    if "proj" in leaf or "norm" in leaf:
        return False
    return any(h in cls for h in _NAME_HINTS) or leaf in ("gate", "router", "indexer")


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """One row per token: the leading dimensions flattened."""
    return tensor.reshape(-1, tensor.shape[-1])


def _parse(output: Any, top_k: int | None, scores: list[torch.Tensor] = ()) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(logits, indices) from a router's output (``scores``: what it handed to torch.topk), or
    None when it is not one."""
    items = list(output) if isinstance(output, (tuple, list)) else [output]
    tensors = [_rows(t) for t in items if isinstance(t, torch.Tensor) and t.dim() >= 2]
    ints = [t for t in tensors if not torch.is_floating_point(t)]
    floats = [t for t in tensors if torch.is_floating_point(t)]
    if ints and not floats and len(items) == 1:  # an indexer: the positions alone, chosen on the scores
        indices = ints[0]
        chosen = [_rows(sc) for sc in scores if sc.dim() >= 2 and sc.numel() // sc.shape[-1] == indices.shape[0]]
        return (chosen[-1], indices) if chosen and chosen[-1].shape[-1] >= indices.shape[-1] else None
    if ints and floats:
        indices = ints[0]
        logits = next((f for f in floats if f.shape[0] == indices.shape[0] and f.shape[1] >= indices.shape[1]), None)
        return (logits, indices) if logits is not None else None
    if floats and top_k and len(items) == 1 and floats[0].shape[-1] > top_k:
        logits = floats[0]
        return logits, torch.topk(logits, top_k, dim=-1).indices
    return None


class _TopkInputs(TorchFunctionMode):
    """Records the scores a router hands to ``torch.topk``: the values its choice is made
    on (e.g. sigmoid(logits) + bias), whatever the architecture computes them from."""

    def __init__(self) -> None:
        super().__init__()
        self.scores: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk) and args:
            self.scores.append(args[0].detach())
        return func(*args, **kwargs)


#: Each routing record's dtype on the CPU, by its name's suffix.
_CPU_DTYPES = {".logits": torch.float32, ".indices": torch.int64, ".scores": torch.float64}


@contextmanager
def capture_routing(layer: torch.nn.Module, top_k: int | None, sink: dict[str, torch.Tensor]) -> Iterator[None]:
    """While the block runs, record each router's ``routing.<name>.logits``, ``.indices`` and,
    where it chose with torch.topk, ``.scores``; they reach ``sink`` as CPU copies when the
    block ends. Until then they stay where the layer made them: on a lazy device a copy
    inside the forward would cut the layer's graph at every router, so a block that ends
    with the device's sync makes them outputs of the layer's one graph."""
    handles = []
    active: dict[str, _TopkInputs] = {}
    held: dict[str, torch.Tensor] = {}

    def pre(name: str):
        def enter(module: torch.nn.Module, args: tuple) -> None:
            mode = _TopkInputs()
            mode.__enter__()
            active[name] = mode

        return enter

    def post(name: str):
        def record(module: torch.nn.Module, args: tuple, output: Any) -> None:
            mode = active.pop(name, None)
            if mode is not None:
                mode.__exit__(None, None, None)
            parsed = _parse(output, top_k, mode.scores if mode else [])
            if parsed is None:
                return
            logits, indices = parsed
            held[f"routing.{name}.logits"] = logits.detach().clone()
            held[f"routing.{name}.indices"] = indices.detach().clone()
            scores = [_rows(sc) for sc in (mode.scores if mode else []) if sc.dim() >= 2]
            scores = [sc for sc in scores if tuple(sc.shape) == tuple(logits.shape)]
            if scores:
                held[f"routing.{name}.scores"] = scores[-1].detach().clone()

        return record

    try:
        for name, module in layer.named_modules():
            if name and looks_like_router(name, module):
                handles.append(module.register_forward_pre_hook(pre(name)))
                handles.append(module.register_forward_hook(post(name)))
        yield
        for key, tensor in held.items():
            sink[key] = tensor.to("cpu").to(_CPU_DTYPES[key[key.rindex(".") :]])
    finally:
        for mode in active.values():  # a forward that raised inside a router
            mode.__exit__(None, None, None)
        for handle in handles:
            handle.remove()


def floor_routing(sink: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The logits and choice scores of a higher-precision run, renamed ``floor.routing.<router>.*``."""
    return {f"floor.{k}": v for k, v in sink.items() if k.endswith((".logits", ".scores"))}
