"""Compare two stores of per-layer outputs without running a model: the goldens, and a
target's ``--save-outputs`` (``python -m pytest_layerparity compare``). The same judge as
the plugin's, on tensors read from the two stores."""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING

from .compare.judge import LayerOutcome, judge_golden
from .options import DTYPES
from .report.entry import ReportEntry
from .report.properties import properties
from .report.text import failure_text
from .selection import layer_key, parse_layer_key
from .store.callspec import hidden_input_name, primary_output_name
from .store.golden import GoldenStore

if TYPE_CHECKING:
    from .options import Settings


class NothingToCompare(Exception):
    """The two stores give nothing to compare: one of them is no store (it has no manifest),
    or no layer that the pattern matches is in both. The message says which."""


def compare_stores(golden_dir: str, target_dir: str, pattern: str, settings: Settings) -> list[ReportEntry]:
    """One report entry per layer that both stores hold and ``pattern`` matches. Raises
    :class:`NothingToCompare` when there is none, and :class:`~.store.golden.GoldenError`
    when a store cannot be read."""
    golden, target = GoldenStore(golden_dir), GoldenStore(target_dir)
    manifest = golden.read_manifest()
    if manifest is None:
        raise NothingToCompare(f"{golden_dir} is not a golden store (no manifest.json)")
    if target.read_manifest() is None:
        raise NothingToCompare(
            f"{target_dir} is not a store of outputs (no manifest.json); write one with --save-outputs"
        )
    layers = sorted(
        index
        for key in set(golden.keys()) & set(target.keys())
        if fnmatch.fnmatch(key, pattern) and (index := parse_layer_key(key)) is not None
    )
    if not layers:
        raise NothingToCompare(f"no layer matches {pattern!r} in both {golden_dir} and {target_dir}")
    dtype = manifest.get("dtype") if manifest.get("dtype") in DTYPES else "float32"
    entries = []
    for index in layers:
        key = layer_key(index)
        g, t = golden.load(key), target.load(key)
        spec = g.metadata["call"]
        name = primary_output_name(spec)
        outcome = judge_golden(
            index,
            g.tensors,
            name,
            t.tensors[name],
            t.tensors,
            settings,
            dtype,
            hidden_in=g.tensors.get(hidden_input_name(spec)),
            envelope=g.envelope,  # the target's arithmetic is not known here: the runs that may sum in float16
        )
        entries.append(_entry(key, index, outcome))
    return entries


def _entry(key: str, index: int, outcome: LayerOutcome) -> ReportEntry:
    """A compared layer's report entry (no properties or placement: it ran in no pytest
    session)."""
    metrics = dict(properties(outcome))
    picture = metrics.pop("failure_picture", None)
    return ReportEntry(
        nodeid=f"compare::{key}",
        layers=str(index),
        verdict="pass" if outcome.passed else "fail",
        metrics=metrics,
        message="" if outcome.passed else _failure(outcome),
        picture=picture,
    )


def _failure(outcome: LayerOutcome) -> str:
    return failure_text(outcome, "(offline compare)", "rerun the layer on the target with -k layer_N")
