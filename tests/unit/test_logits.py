"""The whole-model judge (compare.logits): compact logits, KL on the golden's top-k, near ties."""

from __future__ import annotations

import math

import pytest
import torch

from pytest_layerparity.compare.logits import (
    ModelEnvelope,
    compact_logits,
    describe_model_outcome,
    judge_logits,
    logits_stats,
    tokens_before_divergence,
)


def _logits(seed=0, positions=20, vocab=50, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, positions, vocab, generator=g, dtype=torch.float64) * scale


def test_compact_logits_keep_top_k_and_log_sum_exp():
    logits = _logits()
    golden = compact_logits(logits, 8)
    assert golden["topk_ids"].dtype == torch.int32 and golden["topk_ids"].shape == (1, 20, 8)
    torch.testing.assert_close(golden["logsumexp"], torch.logsumexp(logits, -1).float())
    assert torch.equal(golden["topk_ids"][..., 0].long(), logits.argmax(-1))


def test_long_prompts_logits_are_taken_a_block_of_positions_at_a_time_to_the_same_figures(monkeypatch):
    from pytest_layerparity.compare import logits as module

    golden_logits, target = _logits(1, positions=40).bfloat16(), (_logits(1, positions=40) + _logits(2, positions=40))
    golden = compact_logits(golden_logits, 10)
    whole = logits_stats(golden, target)
    widened = []
    monkeypatch.setattr(module, "BLOCK_ELEMENTS", 50 * 3)  # 14 blocks of 3 positions
    monkeypatch.setattr(module.torch, "log_softmax", lambda x, dim: widened.append(x.shape[0]) or x.log_softmax(dim))
    blocked = compact_logits(golden_logits, 10)
    assert all(torch.equal(blocked[key], golden[key]) for key in golden)
    assert blocked["topk_ids"].shape == (1, 40, 10) and blocked["logsumexp"].shape == (1, 40)
    assert logits_stats(golden, target) == whole and whole.flipped  # the same figures, a flip among them
    assert max(widened) == 3 and sum(widened) == 40  # no more than a block's float64 rows at once


def test_kl_on_the_top_k_is_a_lower_bound_of_the_full_kl_and_zero_for_the_same_logits():
    golden_logits, target = _logits(1), _logits(1) + 0.3 * _logits(2)
    golden = compact_logits(golden_logits, 10)
    assert logits_stats(golden, golden_logits).kl_max == pytest.approx(0, abs=1e-6)
    stats = logits_stats(golden, target)
    p, log_q = torch.softmax(golden_logits, -1), torch.log_softmax(target, -1)
    full = (p * (p.log() - log_q)).sum(-1).flatten()
    assert 0 < stats.kl_mean <= float(full.mean()) + 1e-6
    assert stats.kl_median <= float(full.max())
    assert stats.top1_agreement == pytest.approx(1 - len(stats.flipped) / 20)


def test_a_flip_on_a_near_tie_is_reported_and_one_outside_fails():
    logits = _logits(3)
    top2 = logits.topk(2, -1).indices[0]
    logits[0, 4, top2[4, 1]] = logits[0, 4, top2[4, 0]] - 1e-3  # position 4: the golden's top-2 nearly tie
    golden = compact_logits(logits, 8)
    target = logits.clone()
    for position in (4, 9):  # swap the top-2 logits: the greedy token flips
        a, b = golden["topk_ids"][0, position, :2].long()
        target[0, position, a], target[0, position, b] = logits[0, position, b], logits[0, position, a]
    outcome = judge_logits(golden, target, "bfloat16", tie_tolerance=0.01, false_alarm_rate=1e-3)
    assert outcome.near_ties == [4] and outcome.hard_flips == [9] and not outcome.passed
    assert outcome.stats.first_divergence == 4
    # a perturbed reference run that flipped at a margin as large makes position 9 a legitimate tie too
    margin = float(golden["topk_logits"][0, 9, 0] - golden["topk_logits"][0, 9, 1])
    envelope = ModelEnvelope((1.0, 2.0, 3.0), (margin,))
    outcome = judge_logits(golden, target, "bfloat16", 0.01, 1e-3, envelope)
    assert outcome.hard_flips == [] and outcome.passed


def test_a_runs_largest_margin_drift_anywhere_bounds_the_near_ties_beyond_the_margins_it_flipped():
    """A run's logits move at every position; they flip a token only where the margin is
    smaller than the move. A correct target's logits move as much, at positions whose
    margins may be smaller: the runs' largest shrink of a greedy margin, flipped or not,
    bounds a near tie; a flip beyond it still fails."""
    logits = _logits(3)
    golden = compact_logits(logits, 8)
    top = golden["topk_logits"][0].double()
    margins = top[:, 0] - top[:, 1]
    run = logits.clone()
    ids = golden["topk_ids"][0].long()
    run[0, 2, ids[2, 0]] -= 0.5 * float(margins[2])  # position 2's greedy margin halved, not flipped
    stats = logits_stats(golden, run)
    assert stats.flipped == [] and stats.margin_drift == pytest.approx(0.5 * float(margins[2]), abs=1e-5)
    flipped = logits.clone()
    flipped[0, 2, ids[2, 1]] += 1.25 * float(margins[2])  # the runner-up overtakes by a quarter margin
    assert logits_stats(golden, flipped).margin_drift == pytest.approx(1.25 * float(margins[2]), abs=1e-5)

    small, large = sorted(range(20), key=lambda p: float(margins[p]))[:2]
    target = logits.clone()
    for position in (small, large):  # the greedy token of the two smallest margins flips
        target[0, position, ids[position, 1]] = logits[0, position, ids[position, 0]] + 1e-3
    between = (float(margins[small]) + float(margins[large])) / 2
    runs = ModelEnvelope((1.0, 2.0, 3.0), (float(margins[small]) / 2,), (), (between / 2, between, between / 3))
    assert runs.tie_margin == between
    outcome = judge_logits(golden, target, "float32", 0.0, 1e-3, runs)
    assert outcome.near_ties == [small] and outcome.hard_flips == [large] and not outcome.passed
    assert "by up to" in describe_model_outcome(outcome, "on cpu")
    flips_only = ModelEnvelope((1.0, 2.0, 3.0), (float(margins[small]) / 2,))  # made before the drift was kept
    assert judge_logits(golden, target, "float32", 0.0, 1e-3, flips_only).hard_flips == sorted((small, large))


def test_the_median_kl_is_held_to_the_envelope_of_perturbed_runs():
    logits = _logits(4)
    golden = compact_logits(logits, 8)
    envelope = ModelEnvelope((1e-4, 2e-4, 1.5e-4, 1.2e-4), ())
    limit = envelope.kl_limit(1e-3)
    assert 2e-4 < limit < 1e-1
    close = judge_logits(golden, logits * 1.001, "float32", 0.0, 1e-3, envelope)
    far = judge_logits(golden, logits * 1.5, "float32", 0.0, 1e-3, envelope)
    assert close.passed and close.stats.kl_median < limit
    assert not far.passed and [c.name for c in far.checks if not c.ok] == ["kl_divergence_median"]


def test_the_logit_scale_is_the_slope_on_the_golden_whatever_each_positions_shift():
    logits = _logits(6)
    golden = compact_logits(logits, 8)
    shift = torch.randn(1, 20, 1, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    assert logits_stats(golden, logits).logit_scale == pytest.approx(1.0, abs=1e-6)
    assert logits_stats(golden, logits + shift).logit_scale == pytest.approx(1.0, abs=1e-6)  # softmax's own
    assert logits_stats(golden, 0.9 * logits + shift).logit_scale == pytest.approx(0.9, abs=1e-6)
    flipped = logits.clone()
    flipped[0, 3:6] = _logits(9)[0, 3:6]  # a router's near-tie flip: the positions after it move
    assert logits_stats(golden, flipped).logit_scale == pytest.approx(1.0, abs=1e-6)  # the middle half does not


def test_a_scale_of_every_positions_logits_fails_on_the_logit_scale_where_the_kl_is_within_its_limit():
    """A final norm or an LM head off by 2% scales every logit: the median KL moves by a few
    times its runs' (their spread on the log scale is wide), the slope by far more than the
    runs' spread of it. An envelope made before the logit scale was kept judges the KL alone."""
    logits = _logits(8)
    golden = compact_logits(logits, 8)
    kl = tuple(1e-5 * v for v in (1.0, 3.0, 0.5, 8.0, 2.0, 1.5))
    runs = ModelEnvelope(kl, (), (1.0002, 0.9999, 1.0001, 0.9998, 1.0, 1.0003))
    low, high = runs.scale_range(1e-3, 0.0)
    assert low < 0.9998 and 1.0003 < high < 1.01
    bug = judge_logits(golden, 0.98 * logits, "float32", 0.0, 1e-3, runs)
    assert [c.name for c in bug.checks if not c.ok] == ["logit_scale"]
    assert bug.stats.kl_median < bug.kl_limit and bug.scale_range == (low, high)
    assert "logit_scale" in describe_model_outcome(bug, "on cpu")
    assert judge_logits(golden, logits * (1 + 1e-5), "float32", 0.0, 1e-3, runs).passed
    before = ModelEnvelope(kl, ())  # an envelope without the runs' scales: the KL alone, at the whole rate
    assert judge_logits(golden, 0.98 * logits, "float32", 0.0, 1e-3, before).passed
    assert before.kl_limit(1e-3) < runs.kl_limit(1e-3)  # the rate split over two statistics
    # the golden dtype's rounding of the logits is the least spread of the scale
    wide = runs.scale_range(1e-3, 0.01)
    assert wide[0] < 0.98 < wide[1]


def test_non_finite_target_logits_fail():
    logits = _logits(5)
    target = logits.clone()
    target[0, 0, 0] = math.nan
    outcome = judge_logits(compact_logits(logits, 4), target, "float32", 0.0, 1e-3)
    assert next(c.name for c in outcome.checks if not c.ok) == "logits_nan_inf"


def test_an_envelope_is_read_back_and_a_malformed_one_refused():
    env = ModelEnvelope((1e-4, 3e-4), (0.5,))
    assert ModelEnvelope.from_metadata(env.as_metadata()) == env
    scaled = ModelEnvelope((1e-4, 3e-4), (0.5,), (1.0001, 0.9999))
    assert ModelEnvelope.from_metadata(scaled.as_metadata()) == scaled
    drifted = ModelEnvelope((1e-4, 3e-4), (0.5,), (1.0001, 0.9999), (0.25, 0.75))
    assert ModelEnvelope.from_metadata(drifted.as_metadata()) == drifted
    assert drifted.first(1).margin_drift == (0.25,)
    with pytest.raises(ValueError, match="margin_drift does not match the runs"):
        ModelEnvelope.from_metadata({**drifted.as_metadata(), "margin_drift": [0.25, math.nan]})
    with pytest.raises(ValueError, match="logit_scale does not match the runs"):
        ModelEnvelope.from_metadata({**scaled.as_metadata(), "logit_scale": [1.0]})
    assert ModelEnvelope.from_metadata(None) is None
    with pytest.raises(ValueError, match="malformed whole-model envelope"):
        ModelEnvelope.from_metadata({"kl_median": [1e-4], "flip_margins": []})
    with pytest.raises(ValueError, match="malformed whole-model envelope"):
        ModelEnvelope.from_metadata({"kl_median": "x"})


def test_tokens_before_divergence_counts_the_generated_tokens_a_free_run_would_share():
    # 2 rows, prompt of 4, 2 decode steps: generated positions are 3, 4, 5 and 9, 10, 11
    assert tokens_before_divergence([], 2, 4, 2) == 3
    assert tokens_before_divergence([0, 1, 2], 2, 4, 2) == 3  # flips inside the prompt do not count
    assert tokens_before_divergence([4], 2, 4, 2) == 1
    assert tokens_before_divergence([5, 9], 2, 4, 2) == 0  # the worst row
    assert tokens_before_divergence([3], 1, 4, 0) == 0


def test_judged_outcome_says_how_many_generated_tokens_match():
    torch.manual_seed(0)
    logits = torch.randn(1, 6, 50) * 3
    golden = {**compact_logits(logits, 4), "input_ids": torch.zeros(1, 4, dtype=torch.long)}
    golden["decode_ids"] = torch.zeros(1, 2, dtype=torch.long)
    target = logits.clone()
    assert judge_logits(golden, target, "float32", 0.0, 1e-3).generated_matched == 3
    target[0, 4] = target[0, 4].flip(-1)  # the second generated token's distribution reversed
    outcome = judge_logits(golden, target, "float32", 0.0, 1e-3)
    assert (outcome.generated, outcome.generated_matched) == (3, 1)
    assert "first 1 of 3 generated tokens" in describe_model_outcome(outcome, "on cpu")


def _tie_model(other_choice: bool = False, bug_at: int | None = None):
    """A toy model's step function: at positions 3 and 6 an indexer-like top-1 among four
    candidates all scored exactly 0 (a tie) picks the next token, over the runner-up token 7 by
    a logit margin of 1; elsewhere the choice is clear and its token leads by 7.
    ``other_choice``: a backend that takes another of the equal candidates (as torch-xla's
    top-k does); ``bug_at``: a port whose greedy token at that position is wrong."""

    def step(input_ids, past):
        b, n = input_ids.shape
        scores = torch.zeros(b, n, 4)
        clear = [p for p in range(n) if p not in (3, 6)]
        scores[:, clear, 0] = 1.0
        chosen = scores.topk(1, dim=-1).indices[..., 0]
        if other_choice:
            chosen[:, [3, 6]] = (chosen[:, [3, 6]] + 1) % 4
        lead = torch.full((b, n, 1), 9.0)
        lead[:, [3, 6]] = 3.0
        logits = torch.zeros(b, n, 8)
        logits[..., 7] = 2.0
        logits = logits.scatter(-1, chosen[..., None], lead)
        if bug_at is not None:
            logits[:, bug_at, 7] = 20.0
        return logits, past

    return step


def test_the_whole_models_envelope_takes_another_choice_among_equal_top_k_candidates():
    """glm_moe_dsa's sparse indexer scores many keys exactly 0: torch-xla's top-k takes other
    equal keys than the CPU's, and greedy tokens after them flip. The whole model's envelope
    runs break such ties their own way, so those flips are within it; a wrong token where the
    choice was clear still fails."""
    from pytest_layerparity.reference.model_golden import whole_model_envelope

    prompt = torch.arange(1, 9).reshape(1, 8)
    golden = compact_logits(_tie_model()(prompt, None)[0], 8)
    golden["input_ids"] = prompt
    envelope = whole_model_envelope(_tie_model(), golden, None, 8)
    assert max(envelope.flip_margins) == pytest.approx(1.0, rel=1e-3)  # the runs flipped at the ties' margin
    other = _tie_model(other_choice=True)(prompt, None)[0]
    tolerance = 4 * float(torch.finfo(torch.float32).eps)
    outcome = judge_logits(golden, other, "float32", tolerance, 0.01, envelope)
    assert outcome.passed and outcome.near_ties == [3, 6] and outcome.hard_flips == []
    assert not judge_logits(golden, other, "float32", tolerance, 0.01, None).passed  # rounding alone: hard flips
    wrong = judge_logits(golden, _tie_model(bug_at=0)(prompt, None)[0], "float32", tolerance, 0.01, envelope)
    assert not wrong.passed and wrong.hard_flips == [0]


def test_the_whole_models_runs_go_together_as_many_as_the_devices_memory_holds(monkeypatch):
    from pytest_layerparity.noise import batching
    from pytest_layerparity.reference.model_golden import whole_model_envelope

    prompt = torch.arange(1, 9).reshape(1, 8)
    golden = compact_logits(_tie_model()(prompt, None)[0], 8)
    golden["input_ids"] = prompt
    batches = []

    def small_device(input_ids, past):  # holds at most 4 runs at once
        batches.append(input_ids.shape[0])
        if input_ids.shape[0] > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return _tie_model()(input_ids, past)

    monkeypatch.setattr(batching, "samples_per_forward", lambda samples, tokens, device="cpu": samples)
    envelope = whole_model_envelope(small_device, golden, None, 8)
    assert batches == [8, 4, 4]
    monkeypatch.setattr(batching, "samples_per_forward", lambda samples, tokens, device="cpu": 4)
    assert whole_model_envelope(_tie_model(), golden, None, 8) == envelope  # as if 4 at a time from the start


def test_the_whole_models_envelope_takes_just_over_half_a_layers_runs():
    from pytest_layerparity.reference.model_golden import model_envelope_samples

    assert [model_envelope_samples(k) for k in (0, 1, 2, 3, 6, 12, 13, 24)] == [0, 1, 2, 2, 4, 7, 7, 13]
