"""The tests the plugin adds, one module per kind. Each module declares ``CASES``, what its
test is parametrised over: ``"layers"`` (the selected layers), ``"ranges"``
(``--layer-ranges``), ``"chains"`` (the contiguous runs of the selected layers) or
``"model"`` (one case: the whole model)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..options import Settings

CASE_KINDS = ("layers", "ranges", "chains", "model")
_BY_MODE = {"parity": "parity", "extract": "extraction", "verify": "verify"}


def suite_modules(settings: Settings, has_ranges: bool, has_decode: bool = False, has_model: bool = False) -> list[str]:
    """The suite modules a session collects (dotted names); ``has_decode``: the store holds
    decode-step goldens; ``has_model``: it holds the whole model's and all layers are selected."""
    assert settings.mode is not None
    names = [_BY_MODE[settings.mode]]
    if settings.mode == "parity" and has_decode:
        names.append("decode")
    if settings.mode == "parity" and has_model:
        names.append("whole_model")
    if has_ranges:
        names.append("ranges")
    if settings.chain:
        names.append("chain")
    if settings.bisect:
        names.append("bisect")
    return [f"{__name__}.{name}" for name in names]


def record_outcome(record, layers: str, passed: bool, props, judged: bool = True) -> None:
    """Record a test's layers, verdict (``skipped`` where nothing was ``judged``) and
    (name, value) properties."""
    record("layers", layers)
    record("verdict", "skipped" if not judged else "pass" if passed else "fail")
    for name, value in props:
        record(name, value)
