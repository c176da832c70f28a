"""The parity tests the plugin adds (``--xla``, ``--neuron``, ``--target``)."""
from __future__ import annotations

import pytest

from .report import failure_text, properties


def test_layer_parity(layerparity_case, layerparity_session, layerparity_golden, layerparity_record):
    """The layer, fed its golden input on the target, reproduces its golden output."""
    session = layerparity_session
    outcome = session.parity_layer(layerparity_case)
    record(layerparity_record, str(layerparity_case), outcome.passed, properties(outcome))
    if not outcome.passed:
        drill = session.drill_command(str(layerparity_case), f"layer_{layerparity_case}")
        text = failure_text(outcome, f"on {session.backend.describe()}", drill)
        if session.settings.op_compare:
            from .drill import op_compare

            finding = op_compare(session, layerparity_case, session.op_compare_dir / f"layer_{layerparity_case}")
            layerparity_record("first_failing_op", finding.label or "none")
            text += "\n" + finding.text()
        pytest.fail(text, pytrace=False)


def record(layerparity_record, layers: str, passed: bool, props) -> None:
    layerparity_record("layers", layers)
    layerparity_record("verdict", "pass" if passed else "fail")
    for name, value in props:
        layerparity_record(name, value)
