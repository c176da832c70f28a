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
                               ``"linear"`` (:func:`.kv_nodes.linear_node`), replayed as copies.
                               ``"empty": true``: an entry made though it holds nothing
                               (a prompt's cache, :data:`PROMPT_CACHE`).
    {"dropped": "SomeObject"}  an object that cannot be stored; replayed as None

A prompt's call, made without a cache, records under ``spec["prompt_cache"]`` the empty cache
(a node without keys, of the reference's kind) its replay gets, and under
``spec["cache_update"]`` the keys and values it wrote there (:data:`PROMPT_CACHE`).

A call that updated a KV cache also records, under ``spec["cache_update"]``, the keys and
values the layer appended (``{"layer": 3, "keys": "cache.new_keys", "values": ...}``; for a
call that filled several entries, ``"layers": [0, 1]`` and each entry's appended keys (values)
joined: :func:`.kv_updates.joined_kv`); a linear-attention layer, its convolution and its
recurrent states as it left them in their place (``"states": true``,
:func:`.kv_cache.updated_states`).

The cache argument's name is the callee's: transformers 5.24 renamed the layers' and models'
``past_key_values`` to ``cache``. A call is stored under the name the reference used and
replayed under the name the callee takes (:func:`cache_argument`), so goldens made under one
transformers are tested under the other.

The cache nodes are written and replayed in :mod:`.kv_nodes`, a call's ``cache_update`` in
:mod:`.kv_updates`, from the live cache as :mod:`.kv_cache` reads it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import fields, is_dataclass
from typing import Any

import torch

from .callrecord import CallRecord, Device
from .kv_cache import ENCODER_DECODER_CACHE, UnstorableCache, own_kv_cache
from .kv_nodes import entry_node, past_cache


def _encode_scalar(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    return value


def _decode_scalar(value: Any) -> Any:
    if isinstance(value, dict) and "float" in value:
        return float(value["float"])
    return value


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
        node = entry_node(own, cache_layer, name, tensors)
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
