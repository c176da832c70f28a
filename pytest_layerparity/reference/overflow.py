"""A reference model that overflows in the extraction's dtype: its own output (a decoder
layer's hidden states, or the logits) holds inf/NaN, so no golden can be made of it. The
extraction names that (where, how much, and the dtypes measured not to overflow) instead of
refusing each layer's golden as if a port were at fault."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..store.callspec import first_tensor as callspec_first_tensor


class ReferenceOverflow(Exception):
    """The reference model's own output holds inf/NaN in the extraction's dtype (the message
    says where, and in which dtypes the reference was measured not to)."""


class StopForward(Exception):
    """Raised by a hook to end a measuring forward at the layer it was asked to reach."""


@dataclass(frozen=True)
class Overflow:
    """Where the reference's output first holds inf/NaN: ``layer`` (None: the model's own
    output, named by ``output``) at decode ``step`` (None: the prompt); how many values, and
    the largest finite magnitude beside them."""

    layer: int | None
    step: int | None
    nonfinite: int
    largest: float
    output: str = "the logits"

    def where(self) -> str:
        at = self.output if self.layer is None else f"layer {self.layer}"
        return at if self.step is None else f"{at}, decode step {self.step}"

    def through(self) -> str:
        """How far a measuring forward must run to reach it."""
        at = "the whole forward" if self.layer is None else f"layer {self.layer}"
        return at if self.step is None else f"{at}, on the prompt and its {self.step + 1} decoded token(s)"


@dataclass(frozen=True)
class Measured:
    """One dtype's forward up to the overflow's place: ``first`` its own first overflow (None:
    finite), ``largest`` the largest magnitude there."""

    first: Overflow | None
    largest: float


def first_tensor(output: Any) -> torch.Tensor | None:
    """A layer's output hidden states: its first tensor (:func:`~..store.callspec.first_tensor`),
    or None where it holds none."""
    try:
        return callspec_first_tensor(output)
    except ValueError:
        return None


def nonfinite_stats(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the count of inf/NaN values, the largest finite magnitude), on the tensor's device:
    read when the forward is over, so that watching costs no synchronisation per layer."""
    finite = torch.isfinite(tensor)
    return finite.numel() - finite.sum(), torch.where(finite, tensor.abs(), 0).amax()


def output_overflow(
    tensor: torch.Tensor, step: int | None, output: str, finite: Callable[[torch.Tensor], bool]
) -> Overflow | None:
    """The model's own output (``output``: "the logits") as an overflow, None when finite
    (``finite``: a cheap test for the common case)."""
    if not tensor.is_floating_point() or finite(tensor):
        return None
    count, largest = nonfinite_stats(tensor)
    return Overflow(None, step, int(count), float(largest), output)


@dataclass
class OverflowWatch:
    """Forward hooks on every decoder layer that keep each output's inf/NaN count and largest
    finite magnitude as device scalars (two reductions a layer, no synchronisation); ``first()``
    reads them once the forward is over. ``step`` labels the forwards that follow (None: the
    prompt)."""

    step: int | None = None
    _seen: list[tuple[int, int | None, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _read: int = 0  # of _seen, the entries first() has read
    _first: Overflow | None = None

    @contextlib.contextmanager
    def watching(self, layers: Sequence[torch.nn.Module], stop: int | None = None) -> Iterator[None]:
        """While the block runs, every layer's output is noted; after layer ``stop``'s,
        :class:`StopForward` ends the forward. Hooks are always removed."""

        def hook(index: int) -> Callable[..., None]:
            def note(module: torch.nn.Module, args: Any, output: Any) -> None:
                hidden = first_tensor(output)
                if hidden is not None and hidden.is_floating_point() and hidden.numel():
                    self._seen.append((index, self.step, *nonfinite_stats(hidden)))
                if index == stop:
                    raise StopForward

            return note

        handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def first(self) -> Overflow | None:
        """The first layer output (in the order the layers ran) that held inf/NaN, or None."""
        while self._first is None and self._read < len(self._seen):
            index, step, count, largest = self._seen[self._read]
            self._read += 1
            if int(count):
                self._first = Overflow(index, step, int(count), float(largest))
        return self._first

    def largest(self, layer: int) -> float:
        """The largest finite magnitude of ``layer``'s last output noted (0 when none was)."""
        found = [float(largest) for index, _, _, largest in self._seen if index == layer]
        return found[-1] if found else 0.0


def measured_text(dtype: str, measured: Measured) -> str:
    if measured.first is None:
        return f"{dtype} does not overflow (largest magnitude {measured.largest:.6g})"
    return f"{dtype} overflows too (at {measured.first.where()})"


def overflow_text(
    dtype: str,
    found: Overflow,
    measured: Mapping[str, Measured],
    command: Callable[[str], str],
) -> str:
    """The extraction's error: the reference overflows in ``dtype`` at ``found``; ``measured``
    holds the other dtypes' forwards to the same place; ``command(dtype)`` extracts in one."""
    limit = torch.finfo(getattr(torch, dtype)).max
    # finite values within a factor of 2**10 of the largest the dtype holds: the inf/NaN are an overflow
    what = "overflows" if found.largest * 2**10 >= limit else "gives inf/NaN"
    text = (
        f"the reference model itself {what} in {dtype}: first at {found.where()}, whose output holds "
        f"{found.nonfinite} inf/NaN values (largest finite magnitude {found.largest:.6g}; {dtype} holds at most "
        f"{limit:.6g}). This is the HuggingFace model's own forward on the golden input, not a port; no golden "
        f"was written. Measured through {found.through()}: "
        + ", ".join(measured_text(name, m) for name, m in measured.items())
    )
    finite = [name for name, m in measured.items() if m.first is None]
    if not finite:
        return text + "; the checkpoint gives inf/NaN in every supported dtype: check its weights and config.json"
    return text + f". Extract in {finite[0]}: {command(finite[0])}"
