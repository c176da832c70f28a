"""The call spec's KV-cache nodes (:mod:`.callspec`'s ``{"cache": ...}``): an entry's past keys
and values, its window and linear attention's states, written from the cache a call found
(:func:`entry_node`, :func:`record_cache_entries` for a call that fills several entries) and
replayed as a fresh DynamicCache (:func:`past_cache`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .callrecord import CallRecord, Device
from .kv_cache import (
    ENCODER_DECODER_CACHE,
    LINEAR_CACHE_LAYERS,
    UnstorableCache,
    cache_layer_state,
    cached_kv,
    check_storable,
    find_kv_cache,
    linear_parts,
    seen_tokens,
)


def entry_node(
    cache: Any, layer: int, name: str, tensors: dict[str, torch.Tensor], before: _Entry | None = None
) -> dict[str, Any]:
    """The spec node of entry ``layer`` of ``cache``: its past keys and values, stored as
    ``{name}.keys``/``values``, and how it holds its tokens; as ``before`` says (the entry
    as a call found it) where given, else as the entry is now."""
    linear = None
    if before is None:
        before = _Entry(cached_kv(cache, layer), cache_layer_state(cache, layer))
        linear = linear_node(cache.layers[layer], name, tensors) if layer < len(cache.layers) else None
    node: dict[str, Any] = {"layer": layer}
    if before.past is not None:
        node["keys"], node["values"] = f"{name}.keys", f"{name}.values"
        tensors[node["keys"]] = before.past[0].detach().to("cpu", copy=True)
        tensors[node["values"]] = before.past[1].detach().to("cpu", copy=True)
    node.update(before.state)
    if linear is not None:
        node["linear"] = linear
    return node


def linear_node(entry: Any, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """A linear-attention cache entry (``LINEAR_CACHE_LAYERS``) as a spec node: its kind, its
    number of state indices, and each convolution state (with its kernel size) and recurrent
    state it holds, stored as ``{name}.conv.I``/``{name}.recurrent.I`` (CPU copies: the layer
    updates them in place), and the indices that have a previous state; None for another
    entry."""
    kind = type(entry).__name__
    if kind not in LINEAR_CACHE_LAYERS:
        return None
    node: dict[str, Any] = {"kind": kind, "states": int(entry.number_of_states), "conv": [], "recurrent": []}
    for part, states, ready in linear_parts(entry):
        for index, state in states.items():
            if ready.get(index) and isinstance(state, torch.Tensor):
                stored = f"{name}.{part}.{index}"
                tensors[stored] = state.detach().to("cpu", copy=True)
                item: dict[str, Any] = {"t": stored, "index": int(index)}
                if part == "conv":
                    item["kernel"] = int(entry.conv_kernel_size[index])
                node[part].append(item)
    node["previous"] = [int(i) for i, had in entry.has_previous_state.items() if had]
    return node


@dataclass
class _Entry:
    """A cache entry's past keys and values (None: empty) and how it holds its tokens."""

    past: tuple[torch.Tensor, torch.Tensor] | None
    state: dict[str, int]


def entry_nodes(node: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The cache entries a cache node holds, each ``{"layer": i, "keys": ..., ...}``: its own,
    then those under ``"more"`` (a layer whose call fills several entries)."""
    first = {k: v for k, v in node.items() if k not in ("more", "within")}
    return [first, *(dict(n) for n in node.get("more") or ())]


@dataclass
class CacheSnapshot:
    """The entries of a KV cache as a call found them (their tensors by reference: a storable
    entry replaces, never overwrites, its keys and values as it appends), to tell afterwards
    which entries the call appended to and what each held before."""

    cache: Any
    seen: list[int]
    entries: list[_Entry]

    @classmethod
    def of(cls, args: Any, kwargs: Any) -> CacheSnapshot | None:
        """The cache among a call's arguments as the call is about to find it (None without one)."""
        cache = find_kv_cache([args, kwargs])
        if cache is None:
            return None
        indices = range(len(cache.layers))
        return cls(cache, [_seen(cache, i) for i in indices], [_entry(cache, i) for i in indices])

    def appended_to(self) -> list[int]:
        """The entries the call appended tokens to (created ones included), in order."""
        return [i for i in range(len(self.cache.layers)) if _seen(self.cache, i) > self.before(i)]

    def before(self, i: int) -> int:
        """How many tokens entry ``i`` had been given before the call."""
        return self.seen[i] if i < len(self.seen) else 0

    def entry(self, i: int) -> _Entry:
        return self.entries[i] if i < len(self.entries) else _Entry(None, {})


def _seen(cache: Any, layer: int) -> int:
    try:
        return seen_tokens(cache, layer)
    except UnstorableCache:
        return 0  # refused where the entry is encoded, if the layer's


def _entry(cache: Any, layer: int) -> _Entry:
    try:
        return _Entry(cached_kv(cache, layer), cache_layer_state(cache, layer))
    except UnstorableCache:
        return _Entry(None, {"unstorable": 1})


def record_cache_entries(snapshot: CacheSnapshot | None, layer: int, record: CallRecord) -> list[int]:
    """After a call: the cache entries it appended to (``[layer]`` where it appended to none,
    or to that one alone, as a decoder layer's call does). Where it filled others (a layer of
    two attention blocks with cache indices of their own), its stored cache argument is made
    to hold each of them as the call found it, so that a replay gives the layer all of its
    past."""
    if snapshot is None:
        return [layer]
    touched = snapshot.appended_to()
    if not touched:
        _check_state_kept_in_entries(snapshot.cache, layer)
    if not touched or touched == [layer]:
        return [layer]
    node, name = _top_cache_node(record.spec)
    if node is None:
        raise UnstorableCache(
            f"layer {layer}'s call appended to KV-cache entries {touched} of a cache passed inside another argument, "
            "which a decode-step golden cannot store; extract with --decode-steps 0 (the prompt tests and the whole "
            "model's prompt still run)"
        )
    for i in touched:
        if "unstorable" in snapshot.entry(i).state:
            check_storable(snapshot.cache.layers[i], i)
    for old in entry_nodes(node):
        for part in ("keys", "values"):
            record.tensors.pop(old.get(part, ""), None)
    within = node.get("within")
    nodes = [
        entry_node(snapshot.cache, i, name if k == 0 else f"{name}.{i}", record.tensors, snapshot.entry(i))
        for k, i in enumerate(touched)
    ]
    node.clear()
    node.update(nodes[0])
    node["more"] = nodes[1:]
    if within:
        node["within"] = within
    return touched


def _check_state_kept_in_entries(cache: Any, layer: int) -> None:
    """Raise :class:`UnstorableCache` where layer ``layer`` appended nothing to a cache of a
    model's own class (a subclass of ``DynamicCache``) whose entry for it holds no linear
    attention's states: the layer keeps its state elsewhere in that object (MiniMax's
    lightning-attention layers, in ``MiniMaxCache.linear_cache``), which a replay as a
    ``DynamicCache`` would not give it."""
    from transformers.cache_utils import DynamicCache

    entry = cache.layers[layer] if layer < len(cache.layers) else None
    if type(cache) is DynamicCache or type(entry).__name__ in LINEAR_CACHE_LAYERS:
        return
    raise UnstorableCache(
        f"layer {layer} was given a {type(cache).__name__} and appended nothing to its entry: it keeps its state "
        "elsewhere in that cache, which a decode-step golden cannot store; extract with --decode-steps 0 (the prompt "
        "tests and the whole model's prompt still run)"
    )


def _top_cache_node(spec: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The cache node that is one of a call spec's arguments itself, with its tensors' name."""
    for k, node in (spec.get("kwargs") or {}).items():
        if isinstance(node.get("cache"), dict):
            return node["cache"], f"kwargs.{k}"
    for i, node in enumerate(spec.get("args") or ()):
        if isinstance(node.get("cache"), dict):
            return node["cache"], f"args.{i}"
    return None, ""


def past_cache(node: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], device: Device | None = None) -> Any:
    """A fresh DynamicCache holding layer ``node["layer"]``'s stored past keys and values
    (what the layer is called with in a decode step; other layers' entries stay empty), and
    those of the other entries the node lists (``"more"``), each in an entry of the kind the
    reference's was: a sliding-window entry keeps sliding."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if node.get("within") == ENCODER_DECODER_CACHE:
        from transformers.cache_utils import EncoderDecoderCache

        own = past_cache({k: v for k, v in node.items() if k != "within"}, tensors, device)
        return EncoderDecoderCache(own, DynamicCache())
    cache = DynamicCache()
    entries = {
        int(n["layer"]): n
        for n in entry_nodes(node)
        if "keys" in n or n.get("sliding_window") or "linear" in n or n.get("empty")
    }
    if not entries:
        return cache
    cache.layers.extend(DynamicLayer() for _ in range(max(entries) + 1))
    for index, entry_node in entries.items():
        cache.layers[index] = _past_entry(entry_node, tensors, device)
    return cache


def _past_entry(node: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], device: Device | None) -> Any:
    """A cache entry holding one stored entry's past keys and values."""
    from transformers.cache_utils import DynamicLayer

    window = node.get("sliding_window")
    if node.get("linear"):
        entry = _linear_entry(node["linear"], window, tensors, device)
    elif window:
        entry = _clamped_sliding_layer()(sliding_window=int(window))
    else:
        entry = DynamicLayer()
    if "keys" in node:
        keys, values = tensors[node["keys"]], tensors[node["values"]]
        if device is not None:
            keys, values = keys.to(device), values.to(device)
        entry.update(keys, values)
        if entry.keys.shape == keys.shape:  # the tensors themselves, not the entry's concatenation onto nothing:
            entry.keys, entry.values = keys, values  # on a lazy device the past is then data, as in a real decode step
        if window:
            entry.cumulative_length = int(node.get("seen", keys.shape[-2]))
    return entry


_CLAMPED: list[type] = []


def _clamped_sliding_layer() -> type:
    """transformers' sliding-window entry, whose update keeps every token while it holds fewer
    than the window: it slices its past from ``1 - window``, which eager torch clamps to the
    tensor and a lazy device (torch-xla) refuses ("Value out of range") where the window is
    longer than the past (Gemma 3's 512 under a 32-token prompt). The same entry otherwise."""
    if not _CLAMPED:
        from transformers.cache_utils import DynamicSlidingWindowLayer

        class ClampedSlidingWindowLayer(DynamicSlidingWindowLayer):
            replays = DynamicSlidingWindowLayer.__name__

            def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                past = self.keys if getattr(self, "is_initialized", False) else None
                held = (past.shape[-2] if past is not None else 0) + key_states.shape[-2]
                window = self.sliding_window
                if held < window - 1:
                    self.sliding_window = held + 1  # the slice then keeps all `held` tokens, as eager torch's does
                try:
                    return super().update(key_states, value_states, *args, **kwargs)
                finally:
                    self.sliding_window = window

        _CLAMPED.append(ClampedSlidingWindowLayer)
    return _CLAMPED[0]


def _linear_entry(
    node: Mapping[str, Any], window: Any, tensors: Mapping[str, torch.Tensor], device: Device | None
) -> Any:
    """A linear-attention cache entry of the stored kind holding copies of its stored states
    (on ``device`` when given): each replay updates its own in place."""
    import transformers
    from transformers import cache_utils

    kind = str(node.get("kind"))
    made = getattr(cache_utils, kind, None) if kind in LINEAR_CACHE_LAYERS else None
    if made is None:
        raise ValueError(
            f"the stored call's cache entry is a {kind}, which transformers {transformers.__version__} lacks"
        )
    count = int(node.get("states", 1))
    entry = made(sliding_window=int(window), number_of_states=count) if window else made(number_of_states=count)
    for part, states, ready in linear_parts(entry):
        for item in node.get(part) or ():
            index, stored = int(item["index"]), tensors[item["t"]]
            states[index] = stored.to(device if device is not None else stored.device, copy=True)
            ready[index] = True
            entry.dtype, entry.device = states[index].dtype, states[index].device
            if part == "conv":
                entry.conv_kernel_size[index] = int(item["kernel"])
    for index in node.get("previous") or ():
        entry.has_previous_state[int(index)] = True
    return entry
