"""The parity tests the plugin adds (``--xla``, ``--neuron``, ``--target``)."""

from __future__ import annotations

import pytest

from ..report.properties import properties
from . import record_outcome
from .control import control_note, recorded
from .failure import failing_text, rerun_command

CASES = "layers"


def test_layer_parity(layerparity_case, layerparity_session, layerparity_golden, layerparity_record):
    """The layer, fed its golden input on the target, reproduces its golden output."""
    session = layerparity_session
    outcome = session.parity_layer(layerparity_case)
    judged = not outcome.judged_nothing
    record_outcome(layerparity_record, str(layerparity_case), outcome.passed, properties(outcome), judged)
    if not judged:
        pytest.skip(outcome.unjudged_reason(f"layer {layerparity_case}"))
    if not outcome.passed:
        text = failing_text(
            session,
            [(outcome, f"on {session.backend.describe()}")],
            rerun_command(session, layerparity_case),
            control=recorded(layerparity_record, control_note(session, layerparity_case, failed=[outcome])),
            unsharded=(layerparity_case, "test_layer_parity"),
        )
        if session.settings.op_compare and session.target.compiled:
            text += (
                "\n  op compare: not available for a compiled program (its ops are inside one NEFF); compare the "
                "port's sub-blocks eagerly with: pytest --port nxdi --target cpu --op-compare"
            )
        elif session.settings.op_compare and session.port is not None:
            from ..replay.blocks import block_compare

            blocks = block_compare(session.target, layerparity_case)
            layerparity_record("first_differing_block", blocks.first_differing or "none")
            text += "\n" + blocks.text()
        elif session.settings.op_compare:
            from ..replay.op_compare import op_compare, op_compare_dir

            out_dir = op_compare_dir(session.settings, session.rootpath) / f"layer_{layerparity_case}"
            finding = op_compare(session.target, layerparity_case, out_dir)
            layerparity_record("first_failing_op", finding.label or "none")
            text += "\n" + finding.text()
        pytest.fail(text, pytrace=False)
