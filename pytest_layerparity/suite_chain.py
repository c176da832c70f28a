"""Chained runs (``--chain``)."""
from __future__ import annotations

import pytest

from .report import failure_text, properties
from .suite_parity import record


def test_chain_parity(layerparity_case, layerparity_session, layerparity_golden, layerparity_record):
    """The selected layers, run as a chain on the target (each fed the previous layer's
    target output), stay within tolerance at every layer: the accumulated drift."""
    session = layerparity_session
    outcomes = session.parity_range(layerparity_case)
    failing = [o for o in outcomes if not o.passed]
    props = properties(failing[0] if failing else outcomes[-1])
    for outcome in outcomes:
        props += properties(outcome, prefix=f"layer_{outcome.layer}.")
    record(layerparity_record, f"{layerparity_case.first}-{layerparity_case.last}", not failing, props)
    if failing:
        first = failing[0]
        drill = session.drill_command(str(first.layer), f"layer_{first.layer}")
        head = (f"chain {layerparity_case.first}-{layerparity_case.last}: {len(failing)} of {len(outcomes)} layers "
                f"leave tolerance; the first is layer {first.layer}\n")
        pytest.fail(head + failure_text(first, f"(chained, on {session.backend.describe()})", drill), pytrace=False)
