"""The keys and values a prompt's call writes to its KV cache, kept in the prompt's golden.

The prompt is captured as the model calls its layers, without a cache. Where the model's
layers are known to compute the same output with an empty cache of the model's own kind as
without one (``reference.prompt_cache.unknown_with_cache``: every entry an attention layer's),
the keys and values each layer wrote are what the first decode step found in its entry (its
past, the cache the decode steps start from). They are stored in the prompt's golden as
``cache.new_keys``/``cache.new_values`` (``spec["cache_update"]``, as a decode step's), with
the empty cache the call is replayed with (``spec[PROMPT_CACHE]``: an entry of the
reference's kind, without keys). The precision floor, the perturbed runs and the target all
replay the call with it (``callspec.decode_call``) and take what the layer wrote
(``kv_updates.appended_kv``), judged as a decode step's appended keys and values are. Where they
are not known, the golden says why, and the prompt test records that they were not judged.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .callspec import PROMPT_CACHE, CallRecord
from .kv_nodes import entry_nodes
from .kv_updates import appended_kv, call_cache_node, joined_kv

if TYPE_CHECKING:
    import torch

NOT_STORED = "not_stored"
JUDGED = "judged"
#: Why a layer's prompt keys and values are not judged where it wrote none to the cache it was given.
NOTHING_WRITTEN = (
    "the layer wrote nothing to the empty cache it was given (it keeps its cache elsewhere, or none; its decode "
    "tests judge what it appends)"
)
#: What an old store's prompt golden says: extracted before the prompt's keys and values were kept.
OLD_STORE = "the golden holds no prompt keys and values (extracted before they were stored); re-extract to judge them"


def attach(prompt: CallRecord, step: CallRecord | None, refusal: str | None) -> None:
    """Store in ``prompt`` (a layer's prompt call) the keys and values it wrote to its cache:
    the past the layer's first decode step ``step`` found in each entry it appended to, and
    the empty cache of that kind its replay gets; or, with ``refusal`` (why they are not
    known to be what the call writes) or where ``step`` does not show them, why not."""
    node = call_cache_node(step.spec) if step is not None else None
    entries = entry_nodes(node) if node is not None else []
    argument = _argument(step.spec) if step is not None else None
    if refusal is None:
        refusal = _unusable(step, node, entries)
    if refusal is None and argument not in (prompt.spec.get("kwargs") or {}):
        refusal = "the model does not pass the layer its cache by keyword (a replay could not give it one)"
    prompt.spec = dict(prompt.spec)  # (a spilled call's spec is the spill's own)
    if refusal is not None:
        prompt.spec[PROMPT_CACHE] = {NOT_STORED: refusal}
        return
    assert step is not None
    keys, values = joined_kv([(step.tensors[e["keys"]], step.tensors[e["values"]]) for e in entries])
    prompt.tensors["cache.new_keys"] = keys.clone()
    prompt.tensors["cache.new_values"] = values.clone()
    empty = [_empty_entry(e) for e in entries]
    cache = {**empty[0], "more": empty[1:]} if len(empty) > 1 else empty[0]
    prompt.spec[PROMPT_CACHE] = {"cache": cache, "argument": argument}
    layers = [int(e["layer"]) for e in entries]
    update: dict[str, Any] = {"layer": layers[0], "keys": "cache.new_keys", "values": "cache.new_values"}
    if len(layers) > 1:
        update["layers"] = layers
    prompt.spec["cache_update"] = update


def _unusable(step: CallRecord | None, node: Mapping[str, Any] | None, entries: list[dict[str, Any]]) -> str | None:
    """Why the first decode step's past does not show what the prompt's call wrote, or None."""
    if step is None:
        return "no decode step of this layer was captured (the prompt's keys and values are those it starts from)"
    if node is None or node.get("within") or not entries:
        return "the layer's decode step holds no cache entry of its own keys and values"
    if any("linear" in e for e in entries):
        return "the layer's cache entry holds linear attention's states, not known to leave its output as it is"
    if any("keys" not in e for e in entries):
        return "the layer wrote no keys and values to its cache entry in the prompt"
    return None


def _empty_entry(entry: Mapping[str, Any]) -> dict[str, Any]:
    """An entry node of the same kind as ``entry`` (its window), holding nothing yet."""
    empty: dict[str, Any] = {"layer": int(entry["layer"]), "empty": True}
    if entry.get("sliding_window"):
        empty.update(sliding_window=int(entry["sliding_window"]), seen=0)
    return empty


def _argument(spec: Mapping[str, Any]) -> str | None:
    """The keyword the reference passed its cache under in a call spec (None: positionally)."""
    return next((k for k, n in (spec.get("kwargs") or {}).items() if isinstance(n, dict) and "cache" in n), None)


def stored(spec: Mapping[str, Any]) -> bool:
    """Whether a call spec holds the keys and values its prompt call wrote."""
    return "cache" in (spec.get(PROMPT_CACHE) or {})


def is_prompt(spec: Mapping[str, Any]) -> bool:
    """Whether a call spec is a prompt's that says whether it holds what its call wrote."""
    return PROMPT_CACHE in spec


def takes_cache(module: Any, name: str | None) -> bool:
    """Whether ``module``'s forward can be given a cache as ``name`` (it takes that argument,
    or ``**kwargs``)."""
    if name is None:
        return False
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return True  # a forward whose signature cannot be read: the call will tell
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def unjudged(spec: Mapping[str, Any], module: Any, name: str | None) -> str | None:
    """Why the keys and values of a prompt's call are not judged on ``module`` (its cache
    argument ``name``), or None where they are: replayed with an empty cache."""
    if not is_prompt(spec):
        return OLD_STORE
    node = spec[PROMPT_CACHE] or {}
    if "cache" not in node:
        return str(node.get(NOT_STORED) or OLD_STORE)
    if not takes_cache(module, name or node.get("argument")):
        return f"the layer under test takes no cache argument ({name or node.get('argument')}) and no **kwargs"
    return None


def written(
    args: Any, kwargs: Any, spec: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], unjudged: str | None
) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, str]:
    """After a prompt's replay: the keys and values the call wrote to the empty cache it was
    given, and whether they are judged (``JUDGED``, or "not judged: why": ``unjudged`` says
    why it was given none, or it wrote nothing there).

    A layer that writes nothing to the cache it is given keeps its cache elsewhere, or none (a
    port of the prompt's pass alone, as examples/nxdi_minimax_m2 builds): its prompt test
    judges the output as before, and its decode tests what it appends."""
    if unjudged is not None:
        return None, f"not judged: {unjudged}"
    try:
        return appended_kv(args, kwargs, spec, tensors), JUDGED
    except ValueError:  # the layer appended nothing to its entry
        return None, f"not judged: {NOTHING_WRITTEN}"
