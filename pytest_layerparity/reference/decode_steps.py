"""The reference's decode steps after the prompt: ``--decode-steps`` greedy tokens, one
forward each, every selected layer's call recorded per step (its past keys and values
included)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import ModelError
from ..store.callspec import CallRecord, cache_argument, returned_cache
from ..store.kv_cache import UnstorableCache
from .overflow import OverflowWatch
from .prompt_cache import unknown_with_cache
from .reference_run import ReferenceRun
from .spill import SpilledKV

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


def record_decode_steps(
    model: PreTrainedModel,
    layer_list: Any,
    layers: list[int],
    ids: torch.Tensor,
    run: ReferenceRun,
    capturing: Callable[..., contextlib.AbstractContextManager[None]],
    steps: int,
    kv: SpilledKV | None = None,
    prompt: tuple[Any, torch.Tensor] | None = None,
    watch: OverflowWatch | None = None,
) -> None:
    """The decode steps after the prompt: the prompt once more with the KV cache (unless
    ``prompt`` gives the cache the prompt's forward filled and its last logits), then
    ``--decode-steps`` greedy tokens, one forward each, recording every selected layer's
    call (its past keys and values included) per step. With ``kv``, the cache is held a
    layer at a time (the rest on disk). Each step feeds the model what its generate would
    (the new token, or the whole sequence to a model that slices the cached part off).
    ``watch`` notes each step's layer outputs; ``capturing(layer_list, layers, sink, routing)``
    sends each selected layer's call to ``sink`` while its block runs."""
    import torch

    from ..model.steps import step_input_ids

    def spilling() -> contextlib.AbstractContextManager[None]:
        return kv.hooks(layer_list) if kv is not None else contextlib.nullcontext()

    if prompt is not None:
        cache, last = prompt
    else:
        # the prompt again, for its cache: of its logits only the last position's are used
        parameters = inspect.signature(model.forward).parameters
        last_only = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
        with spilling():
            output = model(input_ids=ids, use_cache=True, **last_only)
        cache = returned_cache(output)
        if getattr(output, "logits", None) is None:  # an encoder: no next token to decode, said in the summary
            run.decode_skipped = (
                f"none: {type(model).__name__} has no LM head (no logits, no next token to decode); its goldens "
                "are the prompt's"
            )
            return
        if cache is None:
            raise ModelError(
                f"--decode-steps {steps}: {type(model).__name__} returned no KV cache "
                "for the prompt with use_cache=True, so it has no decode steps to record; extract with "
                "--decode-steps 0"
            )
        last = output.logits[:, -1]
    name = cache_argument(model.forward, "past_key_values")
    tokens = []
    sequence = ids
    for step in range(steps):
        token = last.argmax(-1, keepdim=True)
        tokens.append(token.cpu())
        sequence = torch.cat([sequence, token.to(sequence.device)], dim=-1)
        fed = step_input_ids(model, sequence, cache, name)  # what generate feeds the model
        routing: dict[int, dict[str, torch.Tensor]] = {i: {} for i in layers}

        def sink(i: int, record: CallRecord, step: int = step) -> None:
            run.decode_calls[(i, step)] = record

        if watch is not None:
            watch.step = step
        try:
            with (
                capturing(layer_list, layers, sink, routing),
                watch.watching(layer_list) if watch is not None else contextlib.nullcontext(),
                spilling(),  # spilled after the capture and the watch saw it
            ):
                output = model(input_ids=fed, **{name: cache}, use_cache=True)
        except UnstorableCache as exc:  # an entry the config did not announce
            raise ModelError(f"--decode-steps {steps}: {exc}") from None
        last = output.logits[:, -1]
        run.decode_logits.append(output.logits[:, -1:].detach().to("cpu", copy=True))  # the new token's
        for i, tensors in routing.items():
            run.decode_calls.add((i, step), tensors)
    run.model_io["decode_ids"] = torch.cat(tokens, dim=-1)


def prompt_kv_unknown(model: Any, layer_list: Any, name: str | None, steps: int) -> str | None:
    """Why the first decode step's past is not known to be what each layer's prompt call
    writes to an empty cache (None where it is: ``store.promptkv``)."""
    if not steps:
        return "extracted with --decode-steps 0 (a prompt golden keeps the keys and values the decode steps start from)"
    return unknown_with_cache(model, layer_list, name)
