"""Re-run the reference and hold it against the stored goldens (``--gpu-golden``)."""
from __future__ import annotations

import pytest

from .report import failure_text, properties


def test_golden_reproducible(layerparity_case, layerparity_session, layerparity_golden, layerparity_record):
    """The reference, re-run on this machine from the stored input, reproduces the golden."""
    session = layerparity_session
    outcome = session.verify_layer(layerparity_case)
    layerparity_record("layers", str(layerparity_case))
    layerparity_record("verdict", "pass" if outcome.passed else "fail")
    for name, value in properties(outcome):
        layerparity_record(name, value)
    if not outcome.passed:
        drill = session.extract_command(str(layerparity_case)) + "   # to replace it"
        pytest.fail(failure_text(outcome, f"re-run on {session.golden_device}", drill), pytrace=False)
