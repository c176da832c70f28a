"""Chained runs (``--chain``)."""

from __future__ import annotations

from .ranges import judge_chain

CASES = "chains"


def test_chain_parity(layerparity_case, layerparity_session, layerparity_golden, layerparity_record):
    """The selected layers, run as a chain on the target (each fed the previous layer's
    target output), stay within tolerance at every layer: the accumulated drift."""
    judge_chain("chain", layerparity_case, layerparity_session, layerparity_record)
