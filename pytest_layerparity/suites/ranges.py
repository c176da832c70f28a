"""The range tests the plugin adds with ``--layer-ranges``."""

from __future__ import annotations

import pytest

from ..report.properties import properties
from . import record_outcome
from .failure import failing_text, rerun_command

CASES = "ranges"


def test_layer_range_parity(layerparity_case, layerparity_session, layerparity_golden, layerparity_record):
    """The range, run end to end on the target from its first layer's golden input,
    stays within tolerance at every layer."""
    judge_chain("range", layerparity_case, layerparity_session, layerparity_record)


def judge_chain(kind: str, layer_range, session, layerparity_record) -> None:
    """Run ``layer_range`` as a chain on the target, record every layer's metrics, and fail
    naming the first layer that leaves tolerance."""
    outcomes = session.parity_range(layer_range)
    failing = [o for o in outcomes if not o.passed]
    props = properties(failing[0] if failing else outcomes[-1])
    for outcome in outcomes:
        props += properties(outcome, prefix=f"layer_{outcome.layer}.")
    record_outcome(layerparity_record, f"{layer_range.first}-{layer_range.last}", not failing, props)
    if failing:
        first = failing[0]
        head = (
            f"{kind} {layer_range.first}-{layer_range.last}: {len(failing)} of {len(outcomes)} layers "
            f"leave tolerance; the first is layer {first.layer}\n"
        )
        where = "in range" if kind == "range" else "chained"
        failure = (first, f"({where}, on {session.backend.describe()})")
        pytest.fail(failing_text(session, [failure], rerun_command(session, first.layer), head=head), pytrace=False)
