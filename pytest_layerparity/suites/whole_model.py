"""The whole-model test the plugin adds when the golden store holds the model's next-token
logits (the top K of ini key ``layerparity_logits_topk``, 16 by default, kept at extraction)
and every layer is selected."""

from __future__ import annotations

import pytest

CASES = "model"


def test_model_parity(layerparity_session, layerparity_record):
    """The whole model on the target, fed the golden prompt and then the golden's decode
    tokens one at a time with its own KV cache (teacher forcing), gives the golden's
    next-token distributions: the same greedy token wherever the golden's is not a near tie,
    and a KL divergence inside what legitimate arithmetic reaches."""
    from ..compare.logits import describe_model_outcome
    from ..store.golden import MODEL_LOGITS_KEY, GoldenError

    session = layerparity_session
    failure = None  # failed outside the except block, so that the message is printed once
    try:
        session.check_store_matches_model()
        outcome = session.target.parity_model(session.load_golden(MODEL_LOGITS_KEY))
    except GoldenError as exc:
        failure = str(exc)
    if failure is not None:
        pytest.fail(failure, pytrace=False)
    s = outcome.stats
    low, high = outcome.scale_range or (None, None)
    layerparity_record("layers", "model")
    layerparity_record("verdict", "pass" if outcome.passed else "fail")
    for name, value in (
        ("positions", s.positions),
        ("top1_agreement", s.top1_agreement),
        ("topk_overlap", s.topk_overlap),
        ("kl_divergence", s.kl_median),
        ("kl_divergence_mean", s.kl_mean),
        ("kl_divergence_max", s.kl_max),
        ("kl_divergence_limit", outcome.kl_limit),
        ("logit_scale", s.logit_scale),
        ("logit_scale_low", low),
        ("logit_scale_high", high),
        ("first_divergence", s.first_divergence),
        ("near_tie_flips", len(outcome.near_ties)),
        ("near_tie_margin", outcome.tie_margin),
        ("margin_drift", s.margin_drift),
        ("greedy_flips_outside_ties", len(outcome.hard_flips)),
        ("envelope_samples", outcome.samples),
        ("generated", outcome.generated),
        ("generated_matched", outcome.generated_matched),
    ):
        layerparity_record(name, value)
    if not outcome.passed:
        from .control import model_control_note, recorded
        from .failure import failing_text

        text = describe_model_outcome(outcome, f"on {session.backend.describe()}")
        control = recorded(layerparity_record, model_control_note(session, session.load_golden(MODEL_LOGITS_KEY)))
        pytest.fail(failing_text(session, text, control=control), pytrace=False)
