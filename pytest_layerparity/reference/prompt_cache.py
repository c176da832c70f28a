"""The prompt's KV cache filled by the capturing forward itself, so that the decode steps
start from it without running the prompt through the model a second time (the reference
forward of a prompt is most of a golden's plain cost: on the CPU a bfloat16 model's forward
is what the goldens are measured against).

The model is called without a cache, as the prompt's goldens record it; each layer is handed
a cache of the model's own kind (transformers' ``DynamicCache`` of its text config, what its
forward and ``generate`` make) after the capture saw its call and taken back before the
capture sees its output. An attention layer's cache update returns the keys and values it was
given (the past is empty), so its output is what it computes without one. Where that is not
known to hold (a model whose layers are not all attention, a cache of its own kind) or the
cache did not fill, the caller runs the prompt again as before."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

#: Layer kinds whose cache entry is a ``DynamicCache`` layer that returns a prefill's keys and
#: values as given.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def unknown_with_cache(model: Any, layer_list: Any, name: str | None) -> str | None:
    """Why the model's layers are not known to compute the same output with an empty cache of
    the model's own kind as without one (None where they are: every layer's entry is an
    attention layer's ``DynamicCache`` entry). The prompt's keys and values are stored only
    where they are known to (``store.promptkv``)."""
    if name is None or not len(layer_list):
        return "its decoder layers take no cache argument"
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if supports is None or not supports():
        return f"{type(model).__name__} makes a cache of its own kind, not transformers' DynamicCache"
    config = model.config.get_text_config(decoder=True)
    kinds = getattr(config, "layer_types", None)
    if kinds is not None and not set(kinds) <= ATTENTION_LAYER_TYPES:
        others = ", ".join(sorted(set(kinds) - ATTENTION_LAYER_TYPES))
        return (
            f"its layers are not all attention layers ({others}): a cache entry that holds other state is not known "
            "to leave a layer's output as it is without a cache"
        )
    return None


def prompt_cache(model: Any, layer_list: Any, name: str | None) -> Any:
    """An empty cache of the model's own kind for its layers to fill during the prompt's
    forward (taken as ``name``), or None where one cannot be known to be that."""
    if unknown_with_cache(model, layer_list, name) is not None:
        return None
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=model.config.get_text_config(decoder=True))


@contextlib.contextmanager
def filling(layer_list: Any, cache: Any, name: str | None) -> Iterator[None]:
    """While the block runs, each layer called without a cache (``name`` None or absent) gets
    ``cache`` under ``name`` for its forward alone: given after the hooks registered before this
    block (a capture records the call as the model made it), taken back before theirs see the
    output. A layer that takes it positionally (GPT-2's blocks) is left as called: the cache
    stays empty there, and the caller runs the prompt again. Nothing where ``cache`` is None."""
    if cache is None:
        yield
        return

    given: set[int] = set()

    def giver(layer: Any) -> Callable[[Any, tuple, dict], None]:
        parameters = list(inspect.signature(layer.forward).parameters)  # read once per layer
        position = parameters.index(name) if name in parameters else None

        def give(module: Any, args: tuple, kwargs: dict) -> None:
            if position is not None and len(args) > position:  # passed positionally: left alone
                return
            if kwargs.get(name) is None:
                kwargs[name] = cache
                given.add(id(module))

        return give

    def take_back(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if id(module) in given:
            given.discard(id(module))
            kwargs[name] = None

    handles = []
    try:
        for layer in layer_list:
            handles.append(layer.register_forward_pre_hook(giver(layer), with_kwargs=True))
            handles.append(layer.register_forward_hook(take_back, with_kwargs=True, prepend=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def filled(cache: Any, layers: int, tokens: int) -> bool:
    """Whether ``cache`` holds ``tokens`` tokens for each of ``layers`` layers."""
    try:
        return len(cache.layers) == layers and all(cache.get_seq_length(i) == tokens for i in range(layers))
    except (AttributeError, TypeError, IndexError):
        return False


def with_or_without(forward: Callable[[Any], T], cache: Any) -> tuple[T, Any]:
    """``forward(cache)`` and the cache; where it raises with a cache (a layer that does not
    take one of this kind), ``forward(None)`` and None: the prompt's goldens as without one."""
    if cache is None:
        return forward(None), None
    try:
        return forward(cache), cache
    except Exception:
        return forward(None), None
