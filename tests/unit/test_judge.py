"""Table tests of the judgement: the verdict's checks (compare.verdict), the statistics
against the precision floor (compare.floor) and the judge (compare.judge), on hand-made
values and small tensors. No model, no store, no session."""

from __future__ import annotations

import math

import pytest
import torch

from pytest_layerparity.compare.floor import FLOOR_KEY, FloorStats, floor_stats
from pytest_layerparity.compare.judge import judge, judge_appended_kv, judge_golden, tie_tolerance
from pytest_layerparity.compare.metrics import Metrics
from pytest_layerparity.compare.verdict import describe_rule, evaluate, noise_limits, policy_in_force
from pytest_layerparity.options import make_settings


def metrics(**changes) -> Metrics:
    values = {
        "max_abs_diff": 0.0,
        "mean_abs_diff": 0.0,
        "similarity_percentage": 100.0,
        "cosine_similarity": 1.0,
        "pearson_correlation": 1.0,
        "numel": 4,
        "golden_nan": 0,
        "golden_inf": 0,
        "target_nan": 0,
        "target_inf": 0,
        "worst_index": (0,),
        "worst_golden": 1.0,
        "worst_target": 1.0,
        "max_rel_diff": 0.0,
    }
    values.update(changes)
    return Metrics(**values)


def floor(**changes) -> FloorStats:
    values = {
        "noise_ratio": 1.0,
        "token_noise_ratio": 1.0,
        "worst_token": 0,
        "golden_error": 1e-3,
        "target_error": 1e-3,
        "delta_cosine": 1.0,
        "tokens": 4,
        "contribution_z": 0.0,
        "golden_contribution_z": 0.0,
    }
    values.update(changes)
    return FloorStats(**values)


def failing(checks) -> list[str]:
    return [c.name for c in checks if not c.ok]


# -- the verdict --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("m", "f", "dtype", "fails"),
    [
        (metrics(), floor(), "bfloat16", []),
        (metrics(target_nan=1), floor(), "bfloat16", ["nan_inf_count"]),
        (metrics(golden_inf=2), floor(), "float32", ["nan_inf_count"]),
        (metrics(cosine_similarity=0.99), floor(), "bfloat16", []),
        (metrics(cosine_similarity=0.9899), floor(), "bfloat16", ["cosine_similarity"]),
        (metrics(cosine_similarity=0.9999), floor(), "float32", []),
        (metrics(cosine_similarity=0.99989), floor(), "float32", ["cosine_similarity"]),
        (metrics(cosine_similarity=math.nan), floor(), "bfloat16", ["cosine_similarity"]),
        (metrics(), floor(noise_ratio=1.5), "bfloat16", []),
        (metrics(), floor(noise_ratio=1.5001), "bfloat16", ["noise_ratio"]),
        (metrics(), floor(token_noise_ratio=3.0), "float16", []),
        (metrics(), floor(token_noise_ratio=3.01), "float16", ["token_noise_ratio"]),
        (metrics(), floor(contribution_z=-6.0), "bfloat16", []),
        (metrics(), floor(contribution_z=-6.01), "bfloat16", ["contribution_bias"]),
        (metrics(), floor(contribution_z=None), "bfloat16", []),
        (metrics(max_abs_diff=5.0), floor(), "bfloat16", []),  # the table's limits do not apply
    ],
)
def test_noise_policy_checks(m, f, dtype, fails):
    checks = evaluate(m, make_settings(), floor=f, dtype=dtype)
    assert failing(checks) == fails
    names = [c.name for c in checks]
    assert names[:4] == ["nan_inf_count", "cosine_similarity", "noise_ratio", "token_noise_ratio"]
    assert ("contribution_bias" in names) == (f.contribution_z is not None)


@pytest.mark.parametrize(
    ("m", "fails"),
    [
        (metrics(), []),
        (metrics(max_abs_diff=0.01), []),
        (metrics(max_abs_diff=0.0101), ["max_abs_diff"]),
        (metrics(mean_abs_diff=0.0011), ["mean_abs_diff"]),
        (metrics(similarity_percentage=94.9), ["similarity_percentage"]),
        (metrics(cosine_similarity=0.98), ["cosine_similarity"]),
        (metrics(pearson_correlation=0.98), ["pearson_correlation"]),
        (metrics(max_abs_diff=math.nan), ["max_abs_diff"]),
    ],
)
def test_table_policy_checks(m, fails):
    assert failing(evaluate(m, make_settings(verdict="table"))) == fails
    # goldens without the precision floor fall back to the table, whatever the policy
    assert failing(evaluate(m, make_settings(verdict="noise"), floor=None)) == fails


def test_options_override_the_limits():
    settings = make_settings(max_noise_ratio=2.0, max_token_noise_ratio=5.0, min_cosine=0.5, max_contribution_z=10.0)
    assert noise_limits(settings, "float32") == (2.0, 5.0, 0.5)
    checks = evaluate(metrics(cosine_similarity=0.6), settings, floor(noise_ratio=1.9, contribution_z=9.9), "float32")
    assert failing(checks) == []
    assert {c.name: c.limit for c in checks}["contribution_bias"] == 10.0


@pytest.mark.parametrize(
    ("dtype", "limits"),
    [("bfloat16", (1.5, 3.0, 0.99)), ("float16", (1.5, 3.0, 0.99)), ("float32", (1.5, 3.0, 0.9999))],
)
def test_default_limits_per_dtype(dtype, limits):
    assert noise_limits(make_settings(), dtype) == limits


@pytest.mark.parametrize(
    ("verdict", "has_floor", "policy"),
    [("noise", True, "noise"), ("noise", False, "table"), ("table", True, "table"), ("table", False, "table")],
)
def test_policy_in_force(verdict, has_floor, policy):
    assert policy_in_force(make_settings(verdict=verdict), has_floor) == policy


def test_describe_rule():
    assert describe_rule(make_settings(), "float32") == (
        "noise policy (float32): fail on NaN/Inf, cosine_similarity < 0.9999, or noise_ratio, token_noise_ratio or "
        "contribution_bias (error against the float32/float64 evaluation, in units of the golden's own error) outside "
        "the layer's noise envelope at false-alarm rate 0.001 per test; goldens without an envelope: "
        "noise_ratio > 1.5, token_noise_ratio > 3, |contribution_bias - golden's| > 6; goldens without the precision "
        "floor use the table policy"
    )
    assert describe_rule(make_settings(verdict="table", min_cosine=0.5), "bfloat16") == (
        "table policy: fail on NaN/Inf, max_abs_diff > 0.01, mean_abs_diff > 0.001, similarity_percentage < 95, "
        "cosine_similarity < 0.5, pearson_correlation < 0.99"
    )


def test_check_text():
    (check,) = [c for c in evaluate(metrics(), make_settings(), floor(noise_ratio=2.5), "float32") if not c.ok]
    assert check.describe() == "noise_ratio                       2.5   <= 1.5        FAIL"


# -- statistics against the precision floor -----------------------------------------------------


def layer_like(seed: int = 0, tokens: int = 16, width: int = 32, noise: float = 1e-3):
    """(input, reference, golden): a layer's contribution, its exact value and a rounded one."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=gen, dtype=torch.float64)
    ref = x + 0.5 * torch.randn(tokens, width, generator=gen, dtype=torch.float64)
    golden = ref + noise * torch.randn(tokens, width, generator=gen, dtype=torch.float64)
    return x, ref, golden


def test_a_target_equal_to_the_golden_is_exactly_one_noise_unit_away():
    x, ref, golden = layer_like()
    stats = floor_stats(golden, golden, ref, x)
    assert stats.noise_ratio == pytest.approx(1.0)
    assert stats.contribution_z == pytest.approx(0.0, abs=1e-9)
    assert stats.delta_cosine == pytest.approx(1.0)
    assert stats.tokens == 16


def test_a_target_equal_to_the_reference_has_no_error():
    x, ref, golden = layer_like()
    stats = floor_stats(golden, ref, ref, x)
    assert stats.noise_ratio == 0.0 and stats.token_noise_ratio == 0.0 and stats.target_error == 0.0


def test_a_bias_along_the_contribution_stands_out_where_noise_of_the_same_size_does_not():
    x, ref, golden = layer_like(noise=1e-3)
    gen = torch.Generator().manual_seed(7)
    other_rounding = ref + 1e-3 * torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    scaled = golden + 1e-3 * (ref - x)  # 0.1% more of the layer's contribution
    noisy = floor_stats(golden, other_rounding, ref, x)
    biased = floor_stats(golden, scaled, ref, x)
    assert abs(noisy.contribution_z) < 4
    assert abs(biased.contribution_z) > 10
    assert noisy.noise_ratio == pytest.approx(1.0, rel=0.2)  # another rounding of the same size


def test_a_bug_on_one_token_shows_in_the_token_ratio():
    x, ref, golden = layer_like(tokens=32)
    target = golden.clone()
    target[5] += 0.05
    stats = floor_stats(golden, target, ref, x)
    assert stats.worst_token == 5
    assert stats.token_noise_ratio > 20 * stats.noise_ratio / math.sqrt(32)


def test_kept_tokens_leave_the_others_out():
    x, ref, golden = layer_like(tokens=8)
    target = golden.clone()
    target[3] += 1.0
    keep = torch.ones(8, dtype=torch.bool)
    keep[3] = False
    assert floor_stats(golden, target, ref, x, keep).noise_ratio == pytest.approx(1.0)
    none = floor_stats(golden, target, ref, x, torch.zeros(8, dtype=torch.bool))
    assert (none.tokens, none.noise_ratio, none.worst_token) == (0, 0.0, -1)


def massive_channel_layer(seed: int = 0, tokens: int = 16, width: int = 64):
    """(input, reference, bfloat16 golden) of a layer whose channel 0 is about 3,000 times the
    others in the residual stream it adds to (a trained model's massive activation), and a
    correct port that rounds only that channel to its other neighbour."""
    x, ref, _ = layer_like(seed, tokens, width)
    shift = 3010.0 + 0.5 * ref[:, 0].abs().clamp_max(1) - ref[:, 0]  # between 3008 and 3024, bfloat16 neighbours
    x[:, 0] += shift
    ref[:, 0] += shift
    golden = ref.to(torch.bfloat16).double()
    port = golden.clone()
    up = torch.nextafter(golden[:, 0].bfloat16(), torch.tensor(torch.inf, dtype=torch.bfloat16)).double()
    down = torch.nextafter(golden[:, 0].bfloat16(), torch.tensor(-torch.inf, dtype=torch.bfloat16)).double()
    port[:, 0] = torch.where(golden[:, 0] > ref[:, 0], down, up)  # the other side of the exact value
    return x, ref, golden, port


def test_relative_ratios_are_not_one_massive_channels_rounding():
    """The absolute ratio is the massive channel's rounding alone; weighed by each element's
    size it counts as one of 64 channels, as large as the golden's own error in the others."""
    x, ref, golden, port = massive_channel_layer()
    absolute = floor_stats(golden, port, ref, x)
    relative = floor_stats(golden, port, ref, x, relative=True)
    assert absolute.noise_ratio > 1.5 and absolute.token_noise_ratio > 1.5
    assert relative.noise_ratio < 1.2 and relative.token_noise_ratio < 2
    assert relative.relative and not absolute.relative
    # the biases and the norms a failure prints are not weighed
    assert relative.golden_error == pytest.approx(absolute.golden_error)
    assert relative.target_error == pytest.approx(absolute.target_error)
    assert relative.contribution_z == pytest.approx(absolute.contribution_z)
    assert floor_stats(golden, golden, ref, x, relative=True).noise_ratio == pytest.approx(1.0)


def test_relative_ratios_still_see_an_error_of_the_small_channels():
    x, ref, golden, _ = massive_channel_layer()
    target = golden.clone()
    target[:, 1:] += 0.01 * (ref[:, 1:] - x[:, 1:])  # 1% of the contribution where it is small
    assert (
        floor_stats(golden, target, ref, x, relative=True).noise_ratio
        > 3 * floor_stats(golden, target, ref, x).noise_ratio
    )


def test_an_element_near_zero_is_weighed_by_its_tokens_median():
    from pytest_layerparity.compare.floor import element_sizes

    ref = torch.tensor([[1e-9, 2.0, -3.0, 4.0, 0.0]], dtype=torch.float64)
    assert element_sizes(ref).tolist() == [[2.0, 2.0, 3.0, 4.0, 2.0]]
    assert bool((element_sizes(torch.zeros(2, 3, dtype=torch.float64)) > 0).all())


def test_the_judge_measures_a_target_as_its_envelope_measured_the_runs():
    from dataclasses import replace

    from pytest_layerparity.compare.envelope import Envelope

    x, ref, golden, port = massive_channel_layer()
    runs = Envelope((1.0, 1.1, 0.9, 1.05), (1.5, 1.7, 1.4, 1.6), (0.5, -0.5, 0.2, 0.1), 0.0, relative=True)
    relative = judge(0, golden, port, make_settings(), "bfloat16", floor=ref, hidden_in=x, envelope=runs)
    absolute = judge(
        0, golden, port, make_settings(), "bfloat16", floor=ref, hidden_in=x, envelope=replace(runs, relative=False)
    )
    assert relative.floor.relative and relative.floor.noise_ratio < 1.2
    assert not absolute.floor.relative and absolute.floor.noise_ratio > 1.5
    assert relative.passed and not absolute.passed


def test_without_the_input_there_is_no_contribution_statistic():
    _, ref, golden = layer_like()
    stats = floor_stats(golden, golden, ref)
    assert stats.contribution_z is None and stats.delta_cosine is None


# -- the judge ---------------------------------------------------------------------------------


def test_identical_outputs_pass_every_check():
    x, ref, golden = layer_like()
    outcome = judge(3, golden.float(), golden.float(), make_settings(), "float32", floor=ref, hidden_in=x.float())
    assert outcome.passed and outcome.layer == 3
    assert all(c.ok for c in outcome.checks)
    assert outcome.tolerance == {"atol": 0.0, "rtol": 0.0}
    assert (outcome.shape, outcome.golden_dtype, outcome.target_dtype) == ((16, 32), "float32", "float32")


def test_a_scaled_contribution_fails_the_floor_checks():
    x, ref, golden = layer_like()
    target = golden + 0.01 * (ref - x)
    outcome = judge(0, golden, target, make_settings(), "float32", floor=ref, hidden_in=x)
    assert not outcome.passed
    assert {"noise_ratio", "contribution_bias"} <= set(failing(outcome.checks))
    assert outcome.tolerance["atol"] == pytest.approx(float((target - golden).abs().max()))


def test_without_a_floor_the_table_decides():
    golden = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    outcome = judge(0, golden, golden + 0.02, make_settings(), "bfloat16")
    assert outcome.floor is None
    assert failing(outcome.checks) == ["max_abs_diff", "mean_abs_diff", "similarity_percentage"]


def test_a_shape_mismatch_names_both_shapes():
    with pytest.raises(AssertionError) as info:
        judge(7, torch.zeros(2, 3), torch.zeros(3, 2), make_settings(), "float32")
    assert str(info.value) == (
        "layer 7: the target's output has shape (3, 2), the golden (2, 3); the port returns something else than the "
        "reference layer"
    )


ROUTER = "mlp.gate"


def golden_tensors(output: torch.Tensor, reference: torch.Tensor) -> dict[str, torch.Tensor]:
    """A golden of 3 tokens whose router chose between 4 experts; token 1's choice between
    experts 1 and 3 is a near tie (exact scores 1e-4 apart), token 2's is not."""
    return {
        "output": output,
        FLOOR_KEY: reference,
        f"routing.{ROUTER}.indices": torch.tensor([[0, 1], [2, 1], [0, 3]]),
        f"routing.{ROUTER}.logits": torch.zeros(3, 4),
        f"routing.{ROUTER}.scores": torch.tensor([[3.0, 2.0, 0.0, 0.0], [0.0, 1.0, 2.0, 0.999], [2.0, 0.0, 0.0, 1.0]]),
        f"floor.routing.{ROUTER}.scores": torch.tensor(
            [[3.0, 2.0, 0.0, 0.0], [0.0, 1.0, 2.0, 1.0 - 1e-4], [2.0, 0.0, 0.0, 1.0]], dtype=torch.float64
        ),
    }


def routed(*rows) -> dict[str, torch.Tensor]:
    return {f"routing.{ROUTER}.indices": torch.tensor(rows)}


@pytest.mark.parametrize(
    ("settings", "excluded", "counted"),
    [
        (make_settings(), [], False),  # near-tie token left out of the floor statistics only
        (make_settings(near_ties="exclude"), [1], False),  # and out of the metrics
        (make_settings(near_ties="strict"), [], True),  # counted
    ],
)
def test_near_tie_flips_are_told_apart(settings, excluded, counted):
    _, ref, golden = layer_like(tokens=3, width=8)
    target = golden.clone()
    target[1] += 1.0  # token 1 went to another expert: its output differs a lot
    tensors = golden_tensors(golden, ref)
    outcome = judge_golden(2, tensors, "output", target, routed([0, 1], [2, 3], [0, 3]), settings, "float32")
    (routing,) = outcome.routing
    assert (routing.flipped, routing.near_tie_flipped, routing.near_tie_tokens) == (1, 1, (1,))
    assert outcome.excluded_tokens == excluded
    assert ("noise_ratio" in failing(outcome.checks)) == counted
    assert ("cosine_similarity" in failing(outcome.checks)) == counted  # the cosine leaves it out too


def test_a_flip_without_a_near_tie_is_reported_as_one():
    _, ref, golden = layer_like(tokens=3, width=8)
    tensors = golden_tensors(golden, ref)
    outcome = judge_golden(0, tensors, "output", golden, routed([0, 1], [2, 1], [0, 1]), make_settings(), "float32")
    (routing,) = outcome.routing
    assert (routing.flipped, routing.near_tie_flipped, routing.flipped_tokens) == (1, 0, (2,))
    assert routing.describe().endswith("1 flipped without a near tie (a routing bug?)")


def test_a_chains_flip_within_the_perturbed_chains_drift_is_a_near_tie():
    """In a chain the router's input has drifted: a flip whose exact margin is beyond four
    times the golden's own rounding of the scores, but within four times what the perturbed
    chains moved them, is a near tie; the drift of a chain that moved no score changes nothing."""
    from pytest_layerparity.compare.routing_agreement import agreement, fold_drift

    _, ref, output = layer_like(tokens=3, width=8)
    golden = golden_tensors(output, ref)
    key = f"routing.{ROUTER}.scores"
    target = routed([0, 1], [2, 1], [0, 1])  # token 2: experts 3 and 1, exact scores 1.0 apart
    assert agreement(ROUTER, golden, target, 0.0).near_tie_tokens == ()
    drift: dict[str, torch.Tensor] = {}
    still = {key: golden[key].clone()}
    fold_drift(golden, still, drift)
    assert agreement(ROUTER, {**golden, **drift}, target, 0.0).near_tie_tokens == ()
    moved = golden[key].clone()
    moved[2, 0] += 0.3  # one chain moved token 2's first score by 0.3: 4 x 0.3 >= 1.0
    fold_drift(golden, {key: moved}, drift)
    fold_drift(golden, still, drift)  # the largest over the chains is kept
    assert drift[f"drift.{key}"].tolist() == pytest.approx([0.0, 0.0, 0.3])
    assert agreement(ROUTER, {**golden, **drift}, target, 0.0).near_tie_tokens == (2,)


def test_candidates_masked_out_are_no_flip():
    """A causal indexer's early queries have fewer candidates than its top-k: which of the
    masked-out (-inf) ones a top-k takes is no choice at all; a real choice still counts."""
    from pytest_layerparity.compare.routing_agreement import agreement

    inf = float("-inf")
    scores = torch.tensor([[1.0, inf, inf, inf], [1.0, 2.0, inf, inf], [1.0, 2.0, 3.0, 4.0]])
    golden = {
        "routing.indexer.indices": torch.tensor([[0, 1], [1, 0], [3, 2]]),
        "routing.indexer.logits": scores,
        "routing.indexer.scores": scores.double(),
        "floor.routing.indexer.scores": scores.double(),
    }
    same = agreement("indexer", golden, {"routing.indexer.indices": torch.tensor([[0, 3], [0, 1], [2, 3]])}, 0.0)
    assert same.flipped == 0
    other = agreement("indexer", golden, {"routing.indexer.indices": torch.tensor([[0, 3], [0, 1], [1, 3]])}, 0.0)
    assert other.flipped_tokens == (2,) and other.near_tie_flipped == 0


def test_routers_the_target_did_not_run_are_left_out():
    _, ref, golden = layer_like(tokens=3, width=8)
    outcome = judge_golden(0, golden_tensors(golden, ref), "output", golden, {}, make_settings(), "float32")
    assert outcome.routing == [] and outcome.passed


@pytest.mark.parametrize(
    ("dtype", "expected"), [("bfloat16", 8 * 2**-7), ("float16", 8 * 2**-10), ("float32", 8 * 2**-23)]
)
def test_tie_tolerance(dtype, expected):
    assert tie_tolerance(make_settings(), dtype) == pytest.approx(expected)
    assert tie_tolerance(make_settings(router_tie_tolerance=2), dtype) == pytest.approx(expected / 4)


def _kv_golden(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ref_k, ref_v = torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g)
    return {
        "cache.new_keys": ref_k.bfloat16(),
        "cache.new_values": ref_v.bfloat16(),
        "floor.cache.new_keys": ref_k,
        "floor.cache.new_values": ref_v,
    }


def test_appended_keys_and_values_are_judged_against_their_floor():
    golden = _kv_golden()
    settings = make_settings()
    same = judge_appended_kv(golden, (golden["cache.new_keys"], golden["cache.new_values"]), settings, "bfloat16")
    assert [c.name for c in same] == [
        "new_keys_cosine",
        "new_keys_noise_ratio",
        "new_values_cosine",
        "new_values_noise_ratio",
    ]
    assert all(c.ok for c in same)
    rotated = golden["cache.new_keys"].roll(1, dims=-1)  # keys rotated at the wrong position
    bad = judge_appended_kv(golden, (rotated, golden["cache.new_values"]), settings, "bfloat16")
    assert {c.name for c in bad if not c.ok} >= {"new_keys_cosine", "new_keys_noise_ratio"}
    scaled = golden["cache.new_values"] * 1.02  # a small scale error: cosine 1, outside the noise
    bad = judge_appended_kv(golden, (golden["cache.new_keys"], scaled), settings, "bfloat16")
    assert [c.name for c in bad if not c.ok] == ["new_values_noise_ratio"]


def test_a_missing_or_short_cache_update_fails_and_a_prompt_golden_has_no_kv_checks():
    golden = _kv_golden()
    settings = make_settings()
    assert [(c.name, c.ok) for c in judge_appended_kv(golden, None, settings, "bfloat16")] == [
        ("kv_cache_appended", False)
    ]
    empty = golden["cache.new_keys"][..., :0, :]
    checks = judge_appended_kv(golden, (empty, empty), settings, "bfloat16")
    assert [(c.name, c.value, c.ok) for c in checks] == [
        ("new_keys_positions", 0, False),
        ("new_values_positions", 0, False),
    ]
    assert judge_appended_kv({"output": torch.ones(2)}, None, settings, "bfloat16") == []


def test_appended_kv_noise_ratio_limit_widens_to_the_steps_envelope_never_narrows():
    from pytest_layerparity.compare.envelope import EnvelopeLimits

    golden = _kv_golden()
    settings = make_settings()
    noisy = golden["cache.new_values"].float() * 1.006  # outside the table's limit

    def limits(max_ratio):
        return EnvelopeLimits(max_ratio, max_ratio, -5.0, 5.0, {}, 12, 5.0)

    def ratio_check(envelope):
        checks = judge_appended_kv(golden, (golden["cache.new_keys"], noisy), settings, "bfloat16", envelope)
        return next(c for c in checks if c.name == "new_values_noise_ratio")

    table = ratio_check(None)
    assert table.limit == 1.5 and not table.ok
    wide = ratio_check(limits(table.value * 2))
    assert wide.limit == table.value * 2 and wide.ok
    assert ratio_check(limits(0.5)).limit == 1.5  # a narrower envelope leaves the table's limit
    # the appended values' own limit from the runs (a few numbers spread more than the output)
    own = EnvelopeLimits(0.5, 0.5, -5.0, 5.0, {}, 12, 5.0, max_appended_noise_ratio={"values": table.value * 3})
    assert ratio_check(own).limit == table.value * 3 and ratio_check(own).ok
    narrow = EnvelopeLimits(0.5, 0.5, -5.0, 5.0, {}, 12, 5.0, max_appended_noise_ratio={"values": 0.1})
    assert ratio_check(narrow).limit == 1.5  # never narrower than the table's


def test_a_linear_layers_updated_states_are_held_to_their_own_runs_not_the_outputs_limit():
    """A linear-attention step's convolution and recurrent states are many numbers: their
    noise ratio is held to the dtype's table or their runs' own limit, never widened to the
    output's (a one-token output's limit is far wider), and the checks name the states."""
    from pytest_layerparity.compare.envelope import EnvelopeLimits

    golden = _kv_golden()
    settings = make_settings()
    noisy = golden["cache.new_values"].float() * 1.006
    wide_output = EnvelopeLimits(12.0, 12.0, -5.0, 5.0, {}, 12, 5.0, max_appended_noise_ratio={"values": 2.0})
    checks = judge_appended_kv(golden, (golden["cache.new_keys"], noisy), settings, "bfloat16", wide_output, True)
    assert [c.name for c in checks] == [
        "new_conv_states_cosine",
        "new_conv_states_noise_ratio",
        "new_recurrent_states_cosine",
        "new_recurrent_states_noise_ratio",
    ]
    ratio = checks[-1]
    assert ratio.limit == 2.0 and ratio.value > 2.0 and not ratio.ok
    as_keys = judge_appended_kv(golden, (golden["cache.new_keys"], noisy), settings, "bfloat16", wide_output)
    assert as_keys[-1].limit == 12.0 and as_keys[-1].ok  # appended keys and values: widened to the output's


def test_a_decode_steps_envelope_keeps_the_appended_keys_and_values_ratios():
    from pytest_layerparity.compare.envelope import Envelope

    env = Envelope((1.0, 1.1, 0.9), (1.0, 1.2, 0.8), (0.0, 1.0, -1.0), 0.5, "mca", (1.0, 2.0, 3.0), (1.5, 1.0, 2.5))
    data = env.as_metadata()
    assert data["new_keys_noise_ratio"] == [1.0, 2.0, 3.0]
    assert Envelope.from_metadata(data) == env
    limits = env.limits(1e-3)
    assert set(limits.max_appended_noise_ratio) == {"keys", "values"}
    assert limits.max_appended_noise_ratio["keys"] > 3.0
    prompt = Envelope((1.0, 1.1), (1.0, 1.2), (0.0, 1.0), 0.5)  # a prompt's (or an older golden's): none
    assert "new_keys_noise_ratio" not in prompt.as_metadata() and prompt.limits(1e-3).max_appended_noise_ratio == {}
    with pytest.raises(ValueError, match="do not match the runs"):
        Envelope.from_metadata({**data, "new_values_noise_ratio": [1.0]})


def _block_case() -> tuple[torch.Tensor, ...]:
    """A layer's input, its float32 output, a bfloat16 golden, a target 1% off, a branch."""
    g0 = torch.Generator().manual_seed(0)
    x = torch.randn(1, 300, 64, generator=g0)
    ref = x + 0.3 * torch.randn(x.shape, generator=g0)
    golden = (ref + 1e-3 * torch.randn(x.shape, generator=g0)).bfloat16()
    target = (1.01 * ref + 1e-3 * torch.randn(x.shape, generator=g0)).bfloat16()
    return x.bfloat16(), ref, golden, target, (0.1 * torch.randn(x.shape, generator=g0)).bfloat16()


@pytest.mark.parametrize("drop", [[], [3, 150, 299]])
def test_floor_stats_in_blocks_of_tokens_equal_one_block(monkeypatch, drop):
    from pytest_layerparity.compare import floor

    x, ref, golden, target, branch = _block_case()
    keep = floor.token_mask(300, drop)
    whole = floor_stats(golden, target, ref, x, keep, {"mlp": branch}).as_dict()
    monkeypatch.setattr(floor, "BLOCK_ELEMENTS", 64 * 7)  # 43 blocks of 7 tokens
    blocked = floor_stats(golden, target, ref, x, keep, {"mlp": branch}).as_dict()
    assert blocked["tokens"] == 300 - len(drop) and blocked["worst_token"] == whole["worst_token"]
    assert whole["contribution_z"] > 1  # the 1% scale is seen along the contribution
    for name, value in whole.items():
        assert blocked[name] == pytest.approx(value, rel=1e-12), name


def test_statistics_are_summed_on_a_cuda_device_among_the_tensors_and_else_on_the_cpu():
    from pytest_layerparity.compare.floor import statistics_device

    assert statistics_device("cpu", "cuda:1", "cuda:0") == torch.device("cuda:1")
    assert statistics_device("xla:0", "cpu") == torch.device("cpu")  # a graph per block there: the CPU
    assert statistics_device("mps") == statistics_device() == torch.device("cpu")  # no float64 there


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("golden_on", ["cuda", "cpu"])
def test_floor_stats_of_cuda_tensors_are_taken_there_and_equal_the_cpus(monkeypatch, golden_on):
    from pytest_layerparity.compare import floor

    x, ref, golden, target, branch = _block_case()
    keep = floor.token_mask(300, [3, 150])
    on_cpu = floor_stats(golden, target, ref, x, keep, {"mlp": branch}).as_dict()
    monkeypatch.setattr(floor, "BLOCK_ELEMENTS", 64 * 7)
    taken, wide = [], floor._wide
    monkeypatch.setattr(floor, "_wide", lambda rows, device, k: taken.append(device) or wide(rows, device, k))
    on_gpu = floor_stats(golden.to(golden_on), target.cuda(), ref.to(golden_on), x, keep, {"mlp": branch})
    assert {d.type for d in taken} == {"cuda"}
    for name, value in on_cpu.items():
        assert on_gpu.as_dict()[name] == pytest.approx(value, rel=1e-9), name


def test_a_sparse_attention_indexer_is_recorded_one_row_per_query():
    """An ``indexer`` returns only the key positions each query attends to ([batch, queries,
    top-k]); its scores are what it handed to torch.topk."""
    from pytest_layerparity.capture.router_hooks import capture_routing

    class Indexer(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scores = x @ x.transpose(-1, -2)
            causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
            return scores.masked_fill(~causal, float("-inf")).topk(2, dim=-1).indices

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.indexer = Indexer()

        def forward(self, x):
            return self.indexer(x)

    layer, sink = Attention(), {}
    x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0))
    with capture_routing(layer, None, sink):
        chosen = layer(x)
    assert sink["routing.indexer.indices"].shape == (10, 2)
    assert torch.equal(sink["routing.indexer.indices"], chosen.reshape(10, 2))
    assert sink["routing.indexer.scores"].shape == (10, 5)


def test_a_call_whose_every_token_routed_apart_on_a_near_tie_is_judged_nothing_and_says_so():
    """A decode step's one token routed to other experts on a near tie: the verdict leaves it
    out, which leaves nothing to judge: the outcome says so rather than passing on nothing."""
    from pytest_layerparity.compare.routing_agreement import RoutingAgreement

    x, ref, golden = layer_like(tokens=1)
    tie = RoutingAgreement("mlp.gate", 1, 0.0, 1, 1, (0,), (0,))
    settings = make_settings()
    outcome = judge(3, golden, golden + 0.3, settings, "float32", floor=ref, hidden_in=x, routing=[tie])
    assert outcome.judged_nothing and outcome.judged_tokens == 0
    assert outcome.unjudged_reason("layer 3, decode step 0") == (
        "layer 3, decode step 0: not judged: every one of its 1 token(s) routed to other experts than the golden's "
        "on a near tie (mlp.gate), which the verdict leaves out as legitimate; --near-ties strict judges them"
    )
    strict = judge(
        3,
        golden,
        golden + 0.3,
        make_settings(near_ties="strict"),
        "float32",
        floor=ref,
        hidden_in=x,
        routing=[tie],
    )
    assert not strict.judged_nothing and not strict.passed  # judged, and far off
    _, _, many = layer_like()
    whole = judge(3, many, many, settings, "float32")  # no routing: every token judged
    assert not whole.judged_nothing and whole.judged_tokens is None


def test_tokens_whose_golden_experts_differ_from_the_floors_are_found():
    """The floor's exact scores pick other experts than the golden did at token 1 alone (a
    near tie the golden broke the other way); a router whose choice is not the plain top-k of
    its scores (most tokens differ), or a call of one token, names none."""
    from pytest_layerparity.compare.routing_agreement import golden_floor_flips

    floor = torch.tensor([[3.0, 2.0, 0.0, 0.0], [0.0, 1.0, 2.0, 1.0 + 1e-4], [2.0, 0.0, 0.0, 1.0]])
    tensors = {
        f"routing.{ROUTER}.indices": torch.tensor([[0, 1], [2, 1], [0, 3]]),
        f"routing.{ROUTER}.scores": torch.tensor([[3.0, 2.0, 0.0, 0.0], [0.0, 1.0, 2.0, 1.0], [2.0, 0.0, 0.0, 1.0]]),
        f"floor.routing.{ROUTER}.scores": floor.double(),
    }
    assert golden_floor_flips(tensors) == (1,)
    grouped = {**tensors, f"routing.{ROUTER}.indices": torch.tensor([[2, 3], [0, 3], [1, 2]])}
    assert golden_floor_flips(grouped) == ()
    one = {k: v[1:2] for k, v in tensors.items()}
    assert golden_floor_flips(one) == ()
    assert golden_floor_flips({"output": torch.zeros(3, 4)}) == ()


def test_a_token_the_golden_routed_apart_from_its_floor_does_not_hide_a_bias():
    """One token whose golden took another expert than its floor (an error the size of the
    output there) makes the golden's error, the statistics' unit, hundreds of times larger: a
    bias of 1% of the contribution reads as noise with the token in and stands out with it
    left out, as the judge leaves it out."""
    x, ref, golden = layer_like(tokens=64, width=64, noise=1e-3)
    golden = golden.clone()
    golden[5] = ref[5] + 0.5 * (ref[5] - x[5])  # the golden's token 5 went to another expert
    target = golden + 1e-2 * (ref - x)
    settings = make_settings()
    kept = judge(2, golden, target, settings, "float32", floor=ref, hidden_in=x, golden_flips=[5])
    hidden = judge(2, golden, target, settings, "float32", floor=ref, hidden_in=x)
    assert kept.golden_flip_tokens == [5] and kept.judged_tokens == 63
    assert abs(kept.floor.contribution_z) > 10 * abs(hidden.floor.contribution_z)
    assert "contribution_bias" in failing(kept.checks)


def test_the_judge_leaves_golden_floor_flips_out_as_the_envelope_did():
    """judge_golden leaves the golden's own routing flips out where the envelope's runs did
    (an envelope that records them, or none at all) and keeps them where an envelope made
    before the rule judged every token."""
    from dataclasses import replace

    from pytest_layerparity.compare.envelope import Envelope

    x, ref, golden = layer_like(tokens=4, width=8)
    scores = torch.tensor([[3.0, 2.0, 0.0, 0.0], [0.0, 1.0, 2.0, 1.0], [2.0, 0.0, 0.0, 1.0], [1.0, 2.0, 0.0, 0.0]])
    floor_scores = scores.double().clone()
    floor_scores[1, 3] += 1e-4  # the floor takes expert 3 over 1 at token 1
    tensors = {
        "output": golden,
        FLOOR_KEY: ref,
        "args.0": x,
        f"routing.{ROUTER}.indices": torch.tensor([[0, 1], [2, 1], [0, 3], [1, 0]]),
        f"routing.{ROUTER}.scores": scores,
        f"floor.routing.{ROUTER}.scores": floor_scores,
    }
    runs = Envelope((1.0, 1.1), (1.0, 1.1), (0.0, 1.0), 0.0, golden_flips=(1,))
    settings = make_settings()
    routing = dict(routed([0, 1], [2, 1], [0, 3], [1, 0]))
    for envelope, flips in ((runs, [1]), (None, [1]), (replace(runs, golden_flips=None), [])):
        outcome = judge_golden(2, tensors, "output", golden, routing, settings, "float32", envelope=envelope)
        assert outcome.golden_flip_tokens == flips


def test_the_failure_text_names_the_golden_floor_flips():
    from pytest_layerparity.report.text import failure_text

    x, ref, golden = layer_like(tokens=64, width=64, noise=1e-3)
    golden = golden.clone()
    golden[5] = ref[5] + 0.5 * (ref[5] - x[5])
    outcome = judge(
        2, golden, golden + 1e-2 * (ref - x), make_settings(), "float32", floor=ref, hidden_in=x, golden_flips=[5]
    )
    assert "higher-precision evaluation): tokens [5]" in failure_text(outcome, "on cpu", "")
