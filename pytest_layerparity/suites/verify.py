"""Re-run the reference and hold it against the stored goldens (``--gpu-golden``)."""

from __future__ import annotations

import pytest

from ..report.properties import properties
from . import record_outcome
from .failure import failing_text

CASES = "layers"


def test_golden_reproducible(layerparity_case, layerparity_session, layerparity_golden, layerparity_record):
    """The reference, re-run on this machine from the stored input, reproduces the golden."""
    session = layerparity_session
    outcome = session.verify_layer(layerparity_case)
    record_outcome(layerparity_record, str(layerparity_case), outcome.passed, properties(outcome))
    if not outcome.passed:
        regenerate = session.commands.extract(str(layerparity_case)) + "   # to replace it"
        where = f"re-run on {session.reference.golden_device}"
        pytest.fail(failing_text(session, [(outcome, where)], regenerate), pytrace=False)
