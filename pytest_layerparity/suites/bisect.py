"""Bisection to the first diverging layer (``--bisect``)."""

from __future__ import annotations

import pytest

from .failure import rerun_command

CASES = "chains"


def test_bisect(layerparity_case, layerparity_session, layerparity_record):
    """Bisect the chain to the first layer whose chained output leaves tolerance."""
    session = layerparity_session
    bad, probes = session.bisect(layerparity_case.layers())
    layerparity_record("layers", f"{layerparity_case.first}-{layerparity_case.last}")
    layerparity_record("verdict", "pass" if bad is None else "fail")
    layerparity_record("range_runs", len(probes))
    layerparity_record("first_bad_layer", "none" if bad is None else bad)
    trail = ", ".join(f"{layerparity_case.first}-{end} {'ok' if ok else 'FAIL'}" for end, ok in probes)
    if bad is not None:
        rerun = rerun_command(session, bad)
        pytest.fail(
            f"bisect {layerparity_case.first}-{layerparity_case.last}: the chain first leaves tolerance at layer {bad} "
            f"({len(probes)} chained range runs: {trail})\n  drill in: {rerun}",
            pytrace=False,
        )
