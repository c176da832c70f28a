"""How a module's whole call (every positional and keyword argument, and the output) is
stored: flat tensors plus a JSON spec that rebuilds it (the golden format's call).

A spec node is one of::

    {"t": "args.0"}            a tensor, stored under that name
    {"v": <json scalar>}       None, bool, int, float (non-finite floats as strings), str
    {"tuple": [...]} / {"list": [...]} / {"dict": {...}}
    {"dtype": "bfloat16"} / {"device": "cpu"}
    {"cache": {"layer": 3, "keys": "kwargs.cache.keys", "values": ...}}
                               a KV cache (transformers' Cache) as the layer saw it: that
                               layer's past keys and values, replayed as a fresh DynamicCache
                               holding them (no keys: an empty cache). A sliding-window (or
                               chunked) layer's entry also records its window and how many
                               tokens it has seen (``"sliding_window": 16, "seen": 33``; it
                               holds the last ``window - 1``), and is replayed as such an entry.
                               A layer whose call fills more than one entry (two attention
                               blocks, each with its own cache index) lists the others under
                               ``"more"``: ``[{"layer": 1, "keys": ..., "values": ...}]``.
                               A linear-attention entry also records its states under
                               ``"linear"`` (:func:`linear_node`), replayed as copies.
                               ``"empty": true``: an entry made though it holds nothing
                               (a prompt's cache, :data:`PROMPT_CACHE`).
    {"dropped": "SomeObject"}  an object that cannot be stored; replayed as None

A prompt's call, made without a cache, records under ``spec["prompt_cache"]`` the empty cache
(a node without keys, of the reference's kind) its replay gets, and under
``spec["cache_update"]`` the keys and values it wrote there (:data:`PROMPT_CACHE`).

A call that updated a KV cache also records, under ``spec["cache_update"]``, the keys and
values the layer appended (``{"layer": 3, "keys": "cache.new_keys", "values": ...}``; for a
call that filled several entries, ``"layers": [0, 1]`` and each entry's appended keys (values)
joined: :func:`joined_kv`); a linear-attention layer, its convolution and its recurrent states
as it left them in their place (``"states": true``, :func:`updated_states`).

The cache argument's name is the callee's: transformers 5.24 renamed the layers' and models'
``past_key_values`` to ``cache``. A call is stored under the name the reference used and
replayed under the name the callee takes (:func:`cache_argument`), so goldens made under one
transformers are tested under the other.

Long because the spec's encoder, decoder and KV-cache nodes are one format, read and written together.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import torch

Device = str | torch.device


@dataclass
class CallRecord:
    """One captured call: flat CPU tensors and the spec that rebuilds args, kwargs, output."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    spec: dict[str, Any] = field(default_factory=dict)


def _encode_scalar(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    return value


def _decode_scalar(value: Any) -> Any:
    if isinstance(value, dict) and "float" in value:
        return float(value["float"])
    return value


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
#: (:func:`linear_node`) and replayed as an entry of the same kind holding copies of them.
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


#: A prompt golden's record of the keys and values its call wrote (``store.promptkv``):
#: ``{"cache": <an empty cache node>, "argument": "cache"}``, the call replayed with that empty
#: cache under the callee's name for it (``argument``: the reference's); or ``{"not_stored":
#: "why"}``.
PROMPT_CACHE = "prompt_cache"

#: The names a decoder layer or model takes its KV cache under, newest first.
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")


def cache_argument(callee: Any, default: str | None = None) -> str | None:
    """The name under which ``callee`` (a module, or a function such as a model's forward)
    takes its KV cache, read from its own signature; ``default`` where it names none (a
    wrapper that passes ``**kwargs`` on, or no cache)."""
    fn = callee.forward if isinstance(callee, torch.nn.Module) else callee
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return default
    return next((name for name in CACHE_ARGUMENTS if name in parameters), default)


def returned_cache(output: Any) -> Any:
    """The KV cache a model returned (``output.cache`` from transformers 5.24,
    ``output.past_key_values`` before), read without the old name's deprecation notice."""
    for name in CACHE_ARGUMENTS[:2]:
        if isinstance(output, Mapping) and output.get(name) is not None:
            return output[name]
    return None


def rename_cache_argument(kwargs: dict[str, Any], name: str | None) -> dict[str, Any]:
    """``kwargs`` with its cache argument (under any of :data:`CACHE_ARGUMENTS`) under ``name``
    (unchanged when ``name`` is None or it is there already)."""
    if name is None or name in kwargs:
        return kwargs
    given = next((k for k in CACHE_ARGUMENTS if k in kwargs), None)
    if given is None:
        return kwargs
    return {(name if k == given else k): v for k, v in kwargs.items()}


def encode(value: Any, name: str, tensors: dict[str, torch.Tensor], cache_layer: int | None = None) -> dict[str, Any]:
    """Encode ``value`` into a spec node, storing tensors into ``tensors`` (as CPU copies).
    A KV cache is stored as layer ``cache_layer``'s past keys and values."""
    own = own_kv_cache(value) if cache_layer is not None else None
    if own is not None:
        node = _entry_node(own, cache_layer, name, tensors)
        if own is not value:
            node["within"] = ENCODER_DECODER_CACHE  # replayed inside one, its cross-attention part empty
        return {"cache": node}
    if isinstance(value, torch.Tensor):
        if value.is_complex():  # safetensors has no complex dtype: stored as (real, imaginary) pairs
            tensors[name] = torch.view_as_real(value.detach().resolve_conj()).to("cpu", copy=True)
            return {"t": name, "complex": True}
        tensors[name] = value.detach().to("cpu", copy=True)
        return {"t": name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"v": _encode_scalar(value)}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, Mapping):
        return {"dict": {str(k): encode(v, f"{name}.{k}", tensors) for k, v in value.items()}}
    if isinstance(value, tuple):
        return {"tuple": [encode(v, f"{name}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return {"list": [encode(v, f"{name}.{i}", tensors) for i, v in enumerate(value)]}
    if cache_layer is not None and type(value).__name__.endswith("Cache"):
        raise UnstorableCache(
            f"the layer's KV cache is a {type(value).__name__}, which a decode-step golden cannot store (replayed "
            "without it, the step would compute another thing); extract with --decode-steps 0 (the prompt tests "
            "and the whole model's prompt still run)"
        )
    return {"dropped": type(value).__name__}


def _entry_node(
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
    for part, states, ready in _linear_parts(entry):
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


def _linear_parts(entry: Any) -> tuple[tuple[str, dict[int, Any], dict[int, bool]], ...]:
    """A linear-attention entry's two parts: (name, its states by index, which of them are
    initialized), convolution first."""
    return (
        ("conv", entry.conv_states, entry.is_conv_states_initialized),
        ("recurrent", entry.recurrent_states, entry.is_recurrent_states_initialized),
    )


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
        _entry_node(snapshot.cache, i, name if k == 0 else f"{name}.{i}", record.tensors, snapshot.entry(i))
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


def decode(node: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], device: Device | None = None) -> Any:
    """Rebuild a value from its spec node; tensors are moved to ``device`` when given."""
    if "t" in node:
        tensor = tensors[node["t"]]
        if node.get("complex"):
            tensor = torch.view_as_complex(tensor.contiguous())
        return tensor.to(device) if device is not None else tensor
    if "v" in node:
        return _decode_scalar(node["v"])
    if "tuple" in node:
        return tuple(decode(n, tensors, device) for n in node["tuple"])
    if "list" in node:
        return [decode(n, tensors, device) for n in node["list"]]
    if "dict" in node:
        return {k: decode(n, tensors, device) for k, n in node["dict"].items()}
    if "dtype" in node:
        return getattr(torch, node["dtype"])
    if "device" in node:
        return torch.device(device) if device is not None else torch.device(node["device"])
    if "cache" in node:
        return past_cache(node["cache"], tensors, device)
    return None


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
    for part, states, ready in _linear_parts(entry):
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


def updated_states(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A linear-attention entry's convolution states and recurrent states as a call left them
    (on the CPU; each part's states flattened per batch row and joined, [batch, n]): what the
    step wrote to its cache, judged as an attention layer's appended keys and values are. None
    for another entry, or one that lacks either part (a convolution-only layer)."""
    entry = cache.layers[layer] if layer < len(cache.layers) else None
    if type(entry).__name__ not in LINEAR_CACHE_LAYERS:
        return None
    parts = []
    for _, states, ready in _linear_parts(entry):
        held = [state for index, state in sorted(states.items()) if ready.get(index) and state is not None]
        if not held:
            return None
        parts.append(torch.cat([state.detach().to("cpu").reshape(state.shape[0], -1) for state in held], dim=-1))
    return parts[0], parts[1]


def tensor_names(node: Any) -> Iterator[str]:
    """The stored tensor names under a spec node, in order. Any JSON is walked (a golden's
    spec is checked with this before it is trusted)."""
    if isinstance(node, dict):
        if isinstance(node.get("t"), str):
            yield node["t"]
            return
        for child in node.values():
            yield from tensor_names(child)
    elif isinstance(node, list):
        for child in node:
            yield from tensor_names(child)


def encode_call(
    args: Sequence[Any], kwargs: Mapping[str, Any], record: CallRecord, cache_layer: int | None = None
) -> None:
    """Encode a call; a KV cache among its arguments is stored as layer ``cache_layer``'s entry."""
    record.spec["args"] = [encode(v, f"args.{i}", record.tensors, cache_layer) for i, v in enumerate(args)]
    record.spec["kwargs"] = {k: encode(v, f"kwargs.{k}", record.tensors, cache_layer) for k, v in kwargs.items()}


def encode_output(output: Any, record: CallRecord) -> None:
    record.spec["output"] = encode(output, "output", record.tensors)


def decode_call(
    spec: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    device: Device | None = None,
    cache_name: str | None = None,
    prompt_cache: bool = True,
) -> tuple[list[Any], dict[str, Any]]:
    """Rebuild a stored call; its cache argument under ``cache_name`` when given (the name
    the callee takes it by: :func:`cache_argument`). A prompt's call that stores the keys and
    values it wrote (``spec[PROMPT_CACHE]``) gets the empty cache it wrote them to, under that
    name (else the reference's), unless not ``prompt_cache``."""
    args = [decode(n, tensors, device) for n in spec["args"]]
    kwargs = rename_cache_argument({k: decode(n, tensors, device) for k, n in spec["kwargs"].items()}, cache_name)
    empty = (spec.get(PROMPT_CACHE) or {}).get("cache") if prompt_cache else None
    name = cache_name or (spec.get(PROMPT_CACHE) or {}).get("argument")
    if empty is not None and name is not None:
        kwargs[name] = past_cache(empty, tensors, device)
    return args, kwargs


def primary_output_name(spec: Mapping[str, Any]) -> str:
    """The name of the output hidden states: the first tensor in the output."""
    for name in tensor_names(spec["output"]):
        return name
    raise ValueError("the captured output holds no tensor")


def hidden_input_name(spec: Mapping[str, Any]) -> str:
    """The name of the input hidden states: the first tensor argument."""
    for node in spec["args"]:
        for name in tensor_names(node):
            return name
    for key in ("hidden_states", "hidden_state", "x", "inputs_embeds"):
        node = spec["kwargs"].get(key)
        if node and "t" in node:
            return node["t"]
    raise ValueError("the captured call has no tensor argument to take as hidden states")


def first_tensor(value: Any) -> torch.Tensor:
    """The first tensor in a (possibly nested) module output: a tensor, tuple, list, mapping
    or dataclass (its fields in order)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        value = list(value.values())
    elif is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in fields(value)]
    if isinstance(value, (tuple, list)):
        for item in value:
            try:
                return first_tensor(item)
            except ValueError:
                continue
    raise ValueError(f"no tensor in the module's output ({type(value).__name__})")


def replace_hidden_input(
    spec: Mapping[str, Any], tensors: dict[str, torch.Tensor], hidden: torch.Tensor
) -> dict[str, torch.Tensor]:
    """A copy of ``tensors`` whose input hidden states are ``hidden`` (for chained runs)."""
    out = dict(tensors)
    out[hidden_input_name(spec)] = hidden
    return out
