"""How many perturbed runs (:mod:`.perturb`) of a call go through the layer or the model
together, as the samples of one batch, on each kind of device."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

T = TypeVar("T")

#: Perturbed runs of a short call go through the layer (or the model) together on the CPU,
#: as the samples of one batch of up to this many tokens: a short call's work is mostly each
#: op's overhead, paid once for all of them (the embedded model's 32-token prompt: 12 runs in
#: one). A long one runs alone, as its memory was planned (four 512-token runs together
#: measured no faster).
BATCHED_TOKENS = 512


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
