"""Record a module's whole call with forward hooks (always removed), encoded as a call spec."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..store.callspec import CallRecord, encode_call, encode_output
from ..store.kv_nodes import CacheSnapshot, record_cache_entries
from ..store.kv_updates import record_cache_update


@contextmanager
def capture_calls(modules: Mapping[int, torch.nn.Module], sink: Callable[[int, CallRecord], None]) -> Iterator[None]:
    """Record each module's call while the block runs; ``sink(index, record)`` gets each one.
    A KV cache passed to module ``index`` is recorded as that layer's past keys and values,
    and what the call appended to it beside the output; where the call appended to other
    entries of it (a layer of two attention blocks, each with its cache index), as the past of
    each entry it appended to, and what it appended to each.

    Hooks are always removed, also when the forward raises.
    """
    handles = []
    pending: dict[int, tuple[CallRecord, CacheSnapshot | None]] = {}
    seen: set[int] = set()

    def pre_hook(index: int):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if index in seen:
                from ..errors import ModelError

                raise ModelError(
                    f"layer {index} ran more than once in one forward pass (a model that loops over some of its "
                    "layers, as a recurrent-depth model does): each run is another computation on another input and "
                    "cache entry, and a golden holds one call per layer; this architecture is not supported"
                )
            seen.add(index)
            record = CallRecord()
            encode_call(args, kwargs, record, cache_layer=index)
            pending[index] = record, CacheSnapshot.of(args, kwargs)

        return hook

    def post_hook(index: int):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            record, snapshot = pending.pop(index)
            encode_output(output, record)
            entries = record_cache_entries(snapshot, index, record)
            record_cache_update(args, kwargs, entries, record)
            sink(index, record)

        return hook

    try:
        for index, module in modules.items():
            handles.append(module.register_forward_pre_hook(pre_hook(index), with_kwargs=True))
            handles.append(module.register_forward_hook(post_hook(index), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def called_layers(layers: Sequence[torch.nn.Module], called: set[int]) -> Iterator[None]:
    """Add to ``called`` the index of each of ``layers`` that runs while the block runs (a
    model may skip a layer for some inputs: a text-only forward skips its cross-attention
    layers). Hooks are always removed, also when the forward raises."""
    handles = []

    def hook(index: int):
        def seen(module: torch.nn.Module, args: tuple) -> None:
            called.add(index)

        return seen

    try:
        for index, module in enumerate(layers):
            handles.append(module.register_forward_pre_hook(hook(index)))
        yield
    finally:
        for handle in handles:
            handle.remove()
