"""How many perturbed runs (:mod:`.perturb`) of a call go through the layer or the model
together, as the samples of one batch, on each kind of device."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from ..store.callspec import cache_argument, decode_call, first_tensor, hidden_input_name, tensor_names
from ..store.kv_nodes import entry_nodes
from ..store.kv_updates import call_cache_node

T = TypeVar("T")

#: Perturbed runs of a short call go through the layer (or the model) together on the CPU,
#: as the samples of one batch of up to this many tokens: a short call's work is mostly each
#: op's overhead, paid once for all of them (the embedded model's 32-token prompt: 12 runs in
#: one). A long one runs alone, as its memory was planned (four 512-token runs together
#: measured no faster).
BATCHED_TOKENS = 512

#: A decode step's past counts against ``BATCHED_TOKENS`` at one token in this many: a run's
#: copy of a past token's keys and values holds a small part of what a prompt token's
#: activations do (2 x the key-value width against several times the hidden and intermediate
#: widths), and a one-token step's run costs mostly what every op costs (each weight widened:
#: 8 layers of 512 past tokens, hidden 1024, one run at a time 9.0 s, 12 together 2.5 s).
PAST_SHARE = 16


def samples_per_forward(samples: int, tokens: int, device: Any = "cpu") -> int:
    """How many of ``samples`` perturbed runs of a call of ``tokens`` tokens go together on
    ``device``. On an accelerator, all of them: there a perturbed op's cost is its dozen
    kernel launches from the host, paid once for every run of the batch (on an H200, 0.28 ms
    an op whatever its size); where they do not fit, fewer (:func:`fewer_fit`)."""
    if torch.device(device).type != "cpu":
        return max(1, samples)
    return max(1, min(samples, BATCHED_TOKENS // max(tokens, 1)))


def fewer_fit(error: BaseException, together: int) -> int | None:
    """After ``together`` perturbed runs in one batch failed with ``error``: how many to try
    together next (half as many, the device's cache emptied), or None where fewer would not
    help (one run, or an error that is not the device's memory running out)."""
    from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

    if together <= 1 or not should_reduce_batch_size(error):
        return None
    clear_device_cache(garbage_collection=True)
    return together // 2


def in_batches(samples: int, group: int, batch: Callable[[int, int], list[T]]) -> Iterator[list[T]]:
    """``batch(k, n)``'s results (the runs k, k + 1, ... it made: n or fewer) until ``samples``
    runs are made, ``group`` at a time, fewer after the device's memory runs out (the same
    runs, the same draws of each batch, as with that many from the start)."""
    k = 0
    while k < samples:
        n = min(group, samples - k)
        try:
            made = batch(k, n)
        except Exception as error:  # re-raised unless the memory ran out
            group = fewer_fit(error, n) or 0
            if not group:
                raise
            continue
        yield made
        k += len(made)


def call_tokens(spec: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> int:
    """Tokens a stored call counts against ``BATCHED_TOKENS`` (what its memory grows with):
    its hidden states' rows, and in a decode step its past's, one in ``PAST_SHARE``."""
    hidden = tensors[hidden_input_name(spec)]
    tokens = hidden.numel() // max(hidden.shape[-1], 1) if hidden.dim() else 1
    past = 0
    for keys_name, _ in _past(spec):
        keys = tensors[keys_name]
        past += keys.shape[0] * keys.shape[-2] if keys.dim() >= 2 else 0
    return tokens + past // PAST_SHARE


def _past(spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The names of the past keys and values of each cache entry a stored call holds."""
    cache = call_cache_node(spec)
    return [(e["keys"], e["values"]) for e in (entry_nodes(cache) if cache is not None else ()) if "keys" in e]


def stacked_call(spec: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """The tensors of a stored call for ``n`` samples of its batch: each argument of two or
    more dimensions whose first is the batch (the hidden states', masks, positions, rotary
    tables, the cache's past) repeated ``n`` times along it; the rest as stored (a 1-D
    ``cache_position`` is positions, not a batch)."""
    batch = tensors[hidden_input_name(spec)].shape[0]
    names = set(tensor_names({"args": spec["args"], "kwargs": spec["kwargs"]}))
    for past in _past(spec):
        names |= set(past)
    out = dict(tensors)
    for name in names:
        t = tensors[name]
        if t.dim() >= 2 and t.shape[0] == batch:
            out[name] = t.repeat(n, *([1] * (t.dim() - 1)))
    return out


def runs_apart(
    layer: torch.nn.Module, spec: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], device: str
) -> bool:
    """Whether ``layer`` computes the samples of a batch apart on this call, as a decoder
    layer does: two different inputs (the golden's, and it halved) run as one batch give
    what each gives alone, to well within the rounding of another batch size (relative
    difference under 1e-2). Checked in plain arithmetic before runs are stacked: a layer or
    an argument that mixes samples would mix the runs."""
    name = hidden_input_name(spec)
    first = tensors[name]
    second = first * 0.5
    cache_name = cache_argument(layer)

    def forward(call: dict[str, torch.Tensor]) -> torch.Tensor:
        args, kwargs = decode_call(spec, call, device, cache_name)
        with torch.no_grad():
            return first_tensor(layer(*args, **kwargs)).detach().to("cpu", torch.float64)

    try:
        both = stacked_call(spec, tensors, 2)
        both[name] = torch.cat([first, second])
        together = forward(both)
        alone = torch.cat([forward({**tensors, name: first}), forward({**tensors, name: second})])
    except (RuntimeError, ValueError, IndexError):
        return False
    if together.shape != alone.shape:
        return False
    return bool(torch.linalg.vector_norm(together - alone) <= 1e-2 * torch.linalg.vector_norm(alone))
