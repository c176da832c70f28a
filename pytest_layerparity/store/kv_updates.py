"""What a call wrote to its KV cache: the keys and values a layer appended (or a linear-attention
layer's states as it left them), stored under the spec's ``cache_update`` after the reference's
call and taken again after a replay (:func:`appended_kv`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .callrecord import CallRecord
from .kv_cache import cached_kv, find_kv_cache, seen_tokens, updated_states
from .kv_nodes import entry_nodes


def record_cache_update(args: Any, kwargs: Any, layers: int | Sequence[int], record: CallRecord) -> None:
    """After a call: store the keys and values it appended to entry ``layers`` (or to each of
    the entries ``layers``, joined: :func:`joined_kv`) of the call's KV cache (their tokens
    beyond the past the spec stored), if the call had a cache."""
    indices = [layers] if isinstance(layers, int) else list(layers)
    new = _appended_all(args, kwargs, indices, record.spec, record.tensors)
    if new is None:
        return
    record.tensors["cache.new_keys"] = new[0].detach().to("cpu", copy=True)
    record.tensors["cache.new_values"] = new[1].detach().to("cpu", copy=True)
    update: dict[str, Any] = {"layer": indices[0], "keys": "cache.new_keys", "values": "cache.new_values"}
    if len(indices) > 1:
        update["layers"] = indices
    if cached_kv(find_kv_cache([args, kwargs]), indices[0]) is None:
        update["states"] = True  # a linear-attention entry's states as the call left them (updated_states)
    record.spec["cache_update"] = update


def joined_kv(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Several entries' appended keys and values as one pair: joined along the tokens where
    they agree in every other dimension, else each flattened per batch row and joined."""
    if len(parts) == 1:
        return parts[0]
    joined = []
    for tensors in zip(*parts, strict=True):
        if len({(t.shape[:-2], t.shape[-1]) for t in tensors}) == 1:
            joined.append(torch.cat(tensors, dim=-2))
        else:
            joined.append(torch.cat([t.reshape(t.shape[0], -1) for t in tensors], dim=-1))
    return joined[0], joined[1]


def _appended_all(
    args: Any, kwargs: Any, layers: Sequence[int], spec: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What the call appended to each of the entries ``layers``, joined (None where any is empty)."""
    parts = [_appended(args, kwargs, i, spec, tensors) for i in layers]
    if any(p is None for p in parts):
        return None
    return joined_kv([p for p in parts if p is not None])


def _cache_node(node: Any) -> dict[str, Any] | None:
    """The first cache node under a spec node (walked by its tags: a keyword argument may
    itself be named ``cache``)."""
    if not isinstance(node, dict):
        return None
    if isinstance(node.get("cache"), dict) and len(node) == 1:
        return node["cache"]
    children = node.get("tuple") or node.get("list") or list((node.get("dict") or {}).values())
    return next((found for child in children if (found := _cache_node(child)) is not None), None)


def call_cache_node(spec: Mapping[str, Any]) -> dict[str, Any] | None:
    """The cache node among a call spec's arguments."""
    nodes = [*(spec.get("args") or ()), *(spec.get("kwargs") or {}).values()]
    return next((found for node in nodes if (found := _cache_node(node)) is not None), None)


def appended_kv(
    args: Any, kwargs: Any, spec: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """After replaying a call that stored a ``cache_update``: the keys and values the layer
    appended to the cache it was given (None when the call stored none)."""
    update = spec.get("cache_update")
    if not update:
        return None
    layers = [int(i) for i in update.get("layers") or [update["layer"]]]
    new = _appended_all(args, kwargs, layers, spec, tensors)
    if new is None:
        which = f"entries {layers}" if len(layers) > 1 else f"layer {layers[0]}'s entry"
        raise ValueError(f"the layer appended nothing to {which} of the KV cache it was given")
    return new


def _appended(
    args: Any, kwargs: Any, layer: int, spec: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Layer ``layer``'s entries in the KV cache among ``args``/``kwargs`` that the call added
    beyond the past its ``spec`` stored: the last of the entry's keys and values, as many as it
    was given tokens (a sliding-window entry drops its oldest as it appends); for a linear-
    attention entry without keys, its states as the call left them (:func:`updated_states`).
    None without a cache, or while the entry is empty."""
    cache = find_kv_cache([args, kwargs])
    now = cached_kv(cache, layer) if cache is not None else None
    if now is None:
        return updated_states(cache, layer) if cache is not None else None
    now = (now[0].to("cpu"), now[1].to("cpu"))  # sliced here: on a lazy device a slice would be a graph to compile
    node = call_cache_node(spec)
    past = next((n for n in entry_nodes(node) if int(n["layer"]) == layer), None) if node is not None else None
    before = 0
    if past is not None and "keys" in past:
        before = int(past.get("seen", tensors[past["keys"]].shape[-2]))
    added = min(seen_tokens(cache, layer) - before, now[0].shape[-2])
    start = now[0].shape[-2] - max(added, 0)
    return now[0][..., start:, :], now[1][..., start:, :]
