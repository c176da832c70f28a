"""The tests the plugin adds, one module per kind. Each module declares ``CASES``, what its
test is parametrised over: ``"layers"`` (the selected layers), ``"ranges"``
(``--layer-ranges``) or ``"chains"`` (the contiguous runs of the selected layers)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..options import Settings

CASE_KINDS = ("layers", "ranges", "chains")
_BY_MODE = {"parity": "parity", "extract": "extract", "verify": "verify"}


def suite_modules(settings: Settings, has_ranges: bool) -> list[str]:
    """The suite modules a session collects (dotted names)."""
    assert settings.mode is not None
    names = [_BY_MODE[settings.mode]]
    if has_ranges:
        names.append("ranges")
    if settings.chain:
        names.append("chain")
    if settings.bisect:
        names.append("bisect")
    return [f"{__name__}.{name}" for name in names]


def record_outcome(record, layers: str, passed: bool, props) -> None:
    """Record a test's layers, verdict and (name, value) properties."""
    record("layers", layers)
    record("verdict", "pass" if passed else "fail")
    for name, value in props:
        record(name, value)
