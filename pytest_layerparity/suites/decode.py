"""The decode-step tests the plugin adds when the golden store holds decode steps
(extracted with ``--decode-steps N``, 2 by default): the layer's single-token path with
its KV cache, the graph a port compiles apart from the prompt's."""

from __future__ import annotations

import pytest

from ..report.properties import properties
from . import record_outcome
from .control import control_note, recorded
from .failure import failing_text, rerun_command

CASES = "layers"


def test_layer_decode_parity(layerparity_case, layerparity_session, layerparity_record):
    """In every stored decode step, the layer fed that step's golden call (the new token's
    hidden state, its position, and the layer's past keys and values as a KV cache)
    reproduces the step's golden output and appends the golden keys and values."""
    from ..store.golden import GoldenError

    session = layerparity_session
    steps = session.store.decode_steps(layerparity_case)
    failure = None  # failed outside the except block, so that the message is printed once
    if not steps:
        failure = (
            f"{session.store.root}: no decode-step golden for layer_{layerparity_case}; extract it with: "
            f"{session.commands.extract(str(layerparity_case))}"
        )
    else:
        try:
            outcomes = session.target.parity_decode(layerparity_case, steps)
        except GoldenError as exc:
            failure = str(exc)
    if failure is not None:
        pytest.fail(failure, pytrace=False)
    judged = [step for step, o in enumerate(outcomes) if not o.judged_nothing]
    worst = next((o for o in outcomes if not o.passed), outcomes[judged[-1] if judged else -1])
    passed = all(o.passed for o in outcomes)
    record_outcome(layerparity_record, str(layerparity_case), passed, properties(worst), bool(judged))
    layerparity_record("decode_steps", len(outcomes))
    layerparity_record("unjudged_steps", [step for step in range(len(outcomes)) if step not in judged])
    if not judged:
        pytest.skip(
            "; ".join(
                o.unjudged_reason(f"layer {layerparity_case}, decode step {step}") for step, o in enumerate(outcomes)
            )
        )
    for check in worst.checks:
        if check.name.startswith(("new_", "kv_")):  # the keys and values appended to the cache
            layerparity_record(check.name, check.value)
    failing = [step for step, o in enumerate(outcomes) if not o.passed]
    layerparity_record("failing_steps", failing)
    if failing:
        text = failing_text(
            session,
            [(outcomes[step], f"decode step {step} on {session.backend.describe()}") for step in failing],
            rerun_command(session, layerparity_case, "test_layer_decode_parity"),
            control=recorded(
                layerparity_record,
                control_note(session, layerparity_case, failing, [outcomes[step] for step in failing]),
            ),
            unsharded=(layerparity_case, "test_layer_decode_parity"),
        )
        pytest.fail(text, pytrace=False)
