"""The differences between a manifest's fields and what a run expects (the store's check
that an extraction writes to a store of its own, and :mod:`.identity`'s that a store is the
model's)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def describe_differences(manifest: Mapping[str, Any], expected: Mapping[str, Any], keys: tuple[str, ...]) -> list[str]:
    """Human-readable differences between a manifest and what this run expects."""
    out = []
    for key in keys:
        have, want = _dig(manifest, key), _dig(expected, key)
        if have != want and not (_is_nan(have) and _is_nan(want)):
            out.append(f"{key}: store has {have!r}, this run has {want!r}")
    return out


def _dig(mapping: Mapping[str, Any], dotted: str) -> Any:
    value: Any = mapping
    for part in dotted.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)
