"""Layer selection specs: ``17``, ``0-30``, ``0-5,10,20-25``, ``all``."""
from __future__ import annotations

import re
from dataclasses import dataclass

_PART = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


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
        if last < first:
            raise SelectionError(
                f"{what} {spec!r}: range {first}-{last} is reversed; write {last}-{first}"
            )
        if last >= num_layers:
            raise SelectionError(f"{what} {spec!r}: layer {last} is out of range; {_valid_range_text(num_layers)}")
        ranges.append(LayerRange(first, last))
    return ranges


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """Return the sorted, de-duplicated layer indices named by ``spec``."""
    if spec.strip().lower() == "all":
        return list(range(num_layers))
    selected: set[int] = set()
    for layer_range in _parse_parts(spec, num_layers, "--layers"):
        selected.update(layer_range.layers())
    return sorted(selected)


def parse_layer_ranges(spec: str, num_layers: int) -> list[LayerRange]:
    """Return the ranges named by ``spec`` (``0-5,6-11``), in the order given."""
    if spec.strip().lower() == "all":
        return [LayerRange(0, num_layers - 1)]
    return _parse_parts(spec, num_layers, "--layer-ranges")
