"""Which layers a run covers: the specs ``17``, ``0-30``, ``0-5,10,20-25``, ``all``; the
contiguous runs of a selection; and the one spelling of a layer's key (``layer_17``), which
names its golden, its test id and its row in the reports."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

_PART = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
_LAYER_KEY = re.compile(r"layer_(\d+)")
_DECODE_KEY = re.compile(r"layer_(\d+)\.decode_(\d+)")
_NUMBER = re.compile(r"\d+")


def layer_key(index: int) -> str:
    """``17`` -> ``layer_17``: the golden's key, the test id, the report's row."""
    return f"layer_{index}"


def parse_layer_key(key: str) -> int | None:
    """``layer_17`` -> 17; None for any other key (``model_io``, ``layers_0-5``)."""
    match = _LAYER_KEY.fullmatch(key)
    return int(match.group(1)) if match else None


def decode_key(index: int, step: int) -> str:
    """``(17, 0)`` -> ``layer_17.decode_0``: the golden of layer 17's first decode step."""
    return f"layer_{index}.decode_{step}"


def parse_decode_key(key: str) -> tuple[int, int] | None:
    """``layer_17.decode_0`` -> (17, 0); None for any other key."""
    match = _DECODE_KEY.fullmatch(key)
    return (int(match.group(1)), int(match.group(2))) if match else None


def golden_layer(key: str) -> int | None:
    """The layer a golden belongs to: ``layer_17`` and ``layer_17.decode_0`` -> 17."""
    index = parse_layer_key(key)
    if index is None and (decode := parse_decode_key(key)) is not None:
        index = decode[0]
    return index


def case_order(test_id: str) -> tuple[str, list[int]]:
    """Sort key of a test id such as ``test_layer_parity[layer_10]`` or
    ``test_chain_parity[layers_0-5]``: the test name, then its layer numbers."""
    name, _, params = test_id.partition("[")
    return name, [int(n) for n in _NUMBER.findall(params)]


class SelectionError(ValueError):
    """A layer spec that is malformed or out of range; the message says what is valid."""


@dataclass(frozen=True)
class LayerRange:
    """An inclusive range of decoder layers, ``first..last``."""

    first: int
    last: int

    @property
    def id(self) -> str:
        return f"layers_{self.first}-{self.last}"

    def layers(self) -> list[int]:
        return list(range(self.first, self.last + 1))


def _valid_range_text(num_layers: int) -> str:
    return f"this model has {num_layers} layers: valid layers are 0-{num_layers - 1}"


def _parse_parts(spec: str, num_layers: int, what: str) -> list[LayerRange]:
    text = spec.strip()
    if not text:
        raise SelectionError(f"{what} is empty; {_valid_range_text(num_layers)} (or 'all')")
    ranges = []
    for part in text.split(","):
        match = _PART.match(part)
        if not match:
            raise SelectionError(
                f"{what} {spec!r}: cannot read {part.strip()!r}; use forms like 17, 0-30, "
                f"0-5,10,20-25 or all ({_valid_range_text(num_layers)})"
            )
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        _check_part(spec, what, first, last, num_layers)
        ranges.append(LayerRange(first, last))
    return ranges


def _check_part(spec: str, what: str, first: int, last: int, num_layers: int) -> None:
    """Refuse a part ``first-last`` that is reversed or leaves the model, in one message whose
    fix is in range (a reversed range's mirror may leave it too)."""
    low, high = min(first, last), max(first, last)
    if high < num_layers:
        if last < first:
            raise SelectionError(f"{what} {spec!r}: range {first}-{last} is reversed; write {last}-{first}")
        return
    valid = _valid_range_text(num_layers)
    if last >= first:
        raise SelectionError(f"{what} {spec!r}: layer {high} is out of range; {valid}")
    fix = "" if low >= num_layers else f"; write {low}" if low == num_layers - 1 else f"; write {low}-{num_layers - 1}"
    raise SelectionError(
        f"{what} {spec!r}: range {first}-{last} is reversed, and layer {high} is out of range; {valid}{fix}"
    )


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """Return the sorted, de-duplicated layer indices named by ``spec``."""
    if spec.strip().lower() == "all":
        return list(range(num_layers))
    selected: set[int] = set()
    for layer_range in _parse_parts(spec, num_layers, "--layers"):
        selected.update(layer_range.layers())
    return sorted(selected)


def contiguous_runs(layers: list[int]) -> list[LayerRange]:
    """The contiguous runs of sorted ``layers``: ``[0, 1, 2, 5, 6]`` -> ``0-2``, ``5-6``."""
    runs: list[LayerRange] = []
    for index in layers:
        if runs and runs[-1].last == index - 1:
            runs[-1] = LayerRange(runs[-1].first, index)
        else:
            runs.append(LayerRange(index, index))
    return runs


def layer_spec(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5`` (what ``--layers`` reads)."""
    return ",".join(str(r.first) if r.first == r.last else f"{r.first}-{r.last}" for r in contiguous_runs(layers))


def parse_layer_ranges(spec: str, num_layers: int) -> list[LayerRange]:
    """Return the ranges named by ``spec`` (``0-5,6-11``), in the order given."""
    if spec.strip().lower() == "all":
        return [LayerRange(0, num_layers - 1)]
    return _parse_parts(spec, num_layers, "--layer-ranges")


def uncalled_text(layers: list[int], uncalled: Mapping[int, str], where: object) -> str:
    """Why the ones of ``layers`` in ``uncalled`` (layer -> its class: the layers the
    extraction's forward did not call, as recorded in ``where``) have no golden."""
    left = [i for i in layers if i in uncalled]
    names = sorted({uncalled[i] for i in left})
    it, has = ("it", "has") if len(left) == 1 else ("them", "have")
    return (
        f"layer{'' if len(left) == 1 else 's'} {layer_spec(left)} ({', '.join(names)}), which the model's forward "
        f"does not call on the golden input (the model skips {it} for this input, as a text-only forward skips a "
        f"cross-attention layer; the extraction recorded {it} in {where}), {has} no golden"
    )


def called_selection(spec: str, layers: list[int], uncalled: Mapping[int, str], where: object) -> list[int]:
    """``layers`` (read from --layers ``spec``) less the ``uncalled`` ones; a selection of
    uncalled layers alone is refused, saying why."""
    kept = [i for i in layers if i not in uncalled]
    if layers and not kept:
        raise SelectionError(f"--layers {spec}: {uncalled_text(layers, uncalled, where)}; select other layers")
    return kept


def check_ranges_called(spec: str, ranges: list[LayerRange], uncalled: Mapping[int, str], where: object) -> None:
    """Refuse a range (of --layer-ranges ``spec``) that holds an ``uncalled`` layer, naming
    the ranges without it."""
    for r in ranges:
        left = [i for i in r.layers() if i in uncalled]
        if left:
            called = [i for i in r.layers() if i not in uncalled]
            instead = f"; name ranges without {'it' if len(left) == 1 else 'them'}" + (
                f" (such as {layer_spec(called)})" if called else ""
            )
            raise SelectionError(
                f"--layer-ranges {spec}: range {r.first}-{r.last}: {uncalled_text(left, uncalled, where)}{instead}"
            )
