"""The range tests the plugin adds with ``--layer-ranges``."""
from __future__ import annotations

import pytest

from .report import failure_text, properties
from .suite_parity import record


def test_layer_range_parity(layerparity_case, layerparity_session, layerparity_golden, layerparity_record):
    """The range, run end to end on the target from its first layer's golden input,
    stays within tolerance at every layer."""
    session = layerparity_session
    outcomes = session.parity_range(layerparity_case)
    failing = [o for o in outcomes if not o.passed]
    worst = failing[0] if failing else outcomes[-1]
    props = properties(worst)
    for outcome in outcomes:
        props += properties(outcome, prefix=f"layer_{outcome.layer}.")
    record(layerparity_record, f"{layerparity_case.first}-{layerparity_case.last}", not failing, props)
    if failing:
        first = failing[0]
        drill = session.drill_command(str(first.layer), f"layer_{first.layer}")
        head = (f"range {layerparity_case.first}-{layerparity_case.last}: {len(failing)} of {len(outcomes)} layers "
                f"leave tolerance; the first is layer {first.layer}\n")
        pytest.fail(head + failure_text(first, f"(in range, on {session.backend.describe()})", drill), pytrace=False)
