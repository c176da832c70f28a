"""A transformers KV cache as a layer's call finds it: which of its entries a golden can store
(keys and values, a sliding window's, linear attention's states) and what each holds.

The spec's nodes for a cache are written and read in :mod:`.kv_nodes`; what a call appended,
in :mod:`.kv_updates`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def is_kv_cache(value: Any) -> bool:
    """A transformers KV cache (``Cache`` and its subclasses: a list of per-layer ``layers``)."""
    return type(value).__name__.endswith("Cache") and isinstance(getattr(value, "layers", None), list)


#: A cache of caches: the self-attention one a decoder layer appends to, beside the
#: cross-attention one an encoder fills (transformers' BERT-family decoders take one always).
ENCODER_DECODER_CACHE = "EncoderDecoderCache"


def own_kv_cache(value: Any) -> Any:
    """The KV cache of a layer's own keys and values in a cache argument: the cache itself, or
    an EncoderDecoderCache's self-attention cache (None for anything else). Raises
    :class:`UnstorableCache` for an EncoderDecoderCache whose cross-attention cache holds keys
    (an encoder's output: a golden stores the layer's own keys and values alone)."""
    if type(value).__name__ == ENCODER_DECODER_CACHE:
        cross = getattr(value, "cross_attention_cache", None)
        if cross is not None and is_kv_cache(cross) and any(cached_kv(cross, i) for i in range(len(cross.layers))):
            raise UnstorableCache(
                "the layer's KV cache holds an encoder's cross-attention keys and values beside its own, which a "
                "decode-step golden cannot store; extract with --decode-steps 0 (the prompt tests and the whole "
                "model's prompt still run)"
            )
        value = getattr(value, "self_attention_cache", None)
    return value if value is not None and is_kv_cache(value) else None


def cached_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Layer ``layer``'s keys and values in ``cache`` (None while it holds none)."""
    if layer >= len(cache.layers):
        return None
    entry = cache.layers[layer]
    keys, values = getattr(entry, "keys", None), getattr(entry, "values", None)
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) or keys.numel() == 0:
        return None
    return keys, values


#: The cache layers whose whole state is keys and values of the tokens they hold (as
#: transformers names them): what a golden stores and replays.
STORABLE_CACHE_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")


#: The cache layers of linear attention (a state-space or gated delta-rule mixer: a convolution
#: state and a recurrent state per state index, updated in place), two of them beside the keys
#: and values of an attention block: stored as their states before the call
#: (:func:`.kv_nodes.linear_node`) and replayed as an entry of the same kind holding copies of them.
LINEAR_CACHE_LAYERS = (
    "LinearAttentionLayer",
    "LinearAttentionAndFullAttentionLayer",
    "LinearAttentionAndSlidingWindowAttentionLayer",
)


#: The entry transformers gives a layer that holds no cache: a layer without attention (an MLP
#: or mixture-of-experts layer of a hybrid), stored as nothing and replayed as an empty cache;
#: or a layer that reads another layer's keys and values (KV sharing), which the up-front check
#: refuses from the config (``reference.support.check_decode_cache``).
EMPTY_CACHE_LAYER = "DummyLayer"


class UnstorableCache(ValueError):
    """A layer's KV-cache entry holds state a golden cannot store."""


def check_storable(entry: Any, layer: int) -> None:
    """Raise :class:`UnstorableCache` for a cache entry that holds state a golden cannot store
    (an indexer's keys, a compressed, static or quantized entry): what is neither keys and
    values, nor linear attention's states (``LINEAR_CACHE_LAYERS``), nor no cache at all
    (``EMPTY_CACHE_LAYER``)."""
    kind = getattr(type(entry), "replays", type(entry).__name__)  # a replay's entry: the kind it stands for
    if kind not in (*STORABLE_CACHE_LAYERS, *LINEAR_CACHE_LAYERS, EMPTY_CACHE_LAYER):
        raise UnstorableCache(
            f"layer {layer}'s KV-cache entry is a {kind}: it holds state beyond keys and values, which a "
            "decode-step golden cannot store; extract with --decode-steps 0 (the prompt tests and the whole "
            "model's prompt still run)"
        )


def cache_layer_state(cache: Any, layer: int) -> dict[str, int]:
    """How layer ``layer``'s cache entry holds its tokens: ``{"sliding_window": w, "seen": n}``
    for a sliding-window (or chunked) entry, which keeps the last ``w - 1`` of the ``n`` tokens
    it was given; ``{}`` for a plain one (all of them, or none yet). Raises
    :class:`UnstorableCache` for an entry that holds state beyond keys and values."""
    if layer >= len(cache.layers):
        return {}
    entry = cache.layers[layer]
    check_storable(entry, layer)
    window = getattr(entry, "sliding_window", None)
    if not getattr(entry, "is_sliding", False) or not window:
        return {}
    return {"sliding_window": int(window), "seen": int(getattr(entry, "cumulative_length", 0))}


def seen_tokens(cache: Any, layer: int) -> int:
    """How many tokens layer ``layer``'s cache entry has been given (held or slid past)."""
    past = cached_kv(cache, layer)
    if past is None:
        return 0
    return cache_layer_state(cache, layer).get("seen", past[0].shape[-2])


def linear_parts(entry: Any) -> tuple[tuple[str, dict[int, Any], dict[int, bool]], ...]:
    """A linear-attention entry's two parts: (name, its states by index, which of them are
    initialized), convolution first."""
    return (
        ("conv", entry.conv_states, entry.is_conv_states_initialized),
        ("recurrent", entry.recurrent_states, entry.is_recurrent_states_initialized),
    )


def find_kv_cache(value: Any) -> Any:
    """The first KV cache of a layer's own keys and values in a (nested) call's arguments
    (an EncoderDecoderCache's self-attention part), or None."""
    own = own_kv_cache(value) if type(value).__name__.endswith("Cache") else None
    if own is not None:
        return own
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for item in value:
            found = find_kv_cache(item)
            if found is not None:
                return found
    return None


def updated_states(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A linear-attention entry's convolution states and recurrent states as a call left them
    (on the CPU; each part's states flattened per batch row and joined, [batch, n]): what the
    step wrote to its cache, judged as an attention layer's appended keys and values are. None
    for another entry, or one that lacks either part (a convolution-only layer)."""
    entry = cache.layers[layer] if layer < len(cache.layers) else None
    if type(entry).__name__ not in LINEAR_CACHE_LAYERS:
        return None
    parts = []
    for _, states, ready in linear_parts(entry):
        held = [state for index, state in sorted(states.items()) if ready.get(index) and state is not None]
        if not held:
            return None
        parts.append(torch.cat([state.detach().to("cpu").reshape(state.shape[0], -1) for state in held], dim=-1))
    return parts[0], parts[1]
