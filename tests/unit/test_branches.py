"""The error along each of a layer's branches (``branch_bias``): measured against the floor,
kept per run in the envelope, held to its range, and the branches found by the floor's pass."""

from __future__ import annotations

import math

import pytest
import torch
from test_judge import layer_like

from pytest_layerparity.compare.envelope import Envelope, t_quantile
from pytest_layerparity.compare.floor import BRANCH_PREFIX, MOVE_PREFIX, branch_directions, branch_moves, floor_stats
from pytest_layerparity.compare.judge import judge, judge_golden
from pytest_layerparity.noise.wide_pass import capture_branches
from pytest_layerparity.options import make_settings


def branch(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_an_error_along_a_branch_stands_out_there_and_not_along_another():
    x, ref, golden = layer_like(noise=1e-3)
    attention, mlp = branch(ref.shape, 1), branch(ref.shape, 2)
    target = golden + 5e-4 * attention  # a small part more of the attention's output
    stats = floor_stats(golden, target, ref, x, directions={"attention": attention, "mlp": mlp})
    assert stats.branch_z["attention"] > 10
    assert abs(stats.branch_z["mlp"]) < 4
    assert stats.branch_bias["attention"] == pytest.approx(
        stats.branch_z["attention"] + stats.golden_branch_z["attention"]
    )
    # the golden itself is its own bias away from the floor, along each branch
    own = floor_stats(golden, golden, ref, x, directions={"attention": attention})
    assert own.branch_z["attention"] == pytest.approx(0.0, abs=1e-9)
    assert own.branch_bias["attention"] == pytest.approx(own.golden_branch_z["attention"])
    assert floor_stats(golden, target, ref, x).branch_bias == {}  # no branches, no statistic


def test_a_branch_of_another_shape_is_left_out_and_blocks_of_tokens_change_nothing(monkeypatch):
    from pytest_layerparity.compare import floor

    x, ref, golden = layer_like(tokens=40, noise=1e-3)
    v = branch(ref.shape, 3)
    target = golden + 1e-4 * v
    keep = floor.token_mask(40, [2, 17])
    whole = floor_stats(golden, target, ref, x, keep, {"a": v, "odd": v[:3]})
    assert set(whole.branch_z) == {"a"}
    monkeypatch.setattr(floor, "BLOCK_ELEMENTS", ref.shape[-1] * 7)
    blocked = floor_stats(golden, target, ref, x, keep, {"a": v})
    assert blocked.branch_z["a"] == pytest.approx(whole.branch_z["a"], rel=1e-12)


def envelope_with_branches() -> Envelope:
    return Envelope(
        noise_ratio=(1.0, 1.1, 0.9, 1.05),
        token_noise_ratio=(2.0, 2.2, 1.8, 2.1),
        contribution_bias=(0.5, -0.5, 1.0, 0.0),
        golden_bias=1.0,
        branch_bias={"self_attn": (1.0, 7.0, 4.0, 4.0), "mlp": (0.0, 0.5, -0.5, 0.0)},
        golden_branch_bias={"self_attn": 4.0, "mlp": -2.0},
    )


def test_the_branches_round_trip_and_each_gets_its_range_with_the_rate_split_over_them():
    env = envelope_with_branches()
    assert Envelope.from_metadata(env.as_metadata()) == env
    limits = env.limits(1e-3)
    q = t_quantile(1 - 1e-3 / 5 / 2, 3)  # three statistics and two branches, both sides
    sd = math.sqrt(sum((v - 4.0) ** 2 for v in (1.0, 7.0, 4.0, 4.0)) / 3)  # above one unit
    low, high = limits.branch_bias["self_attn"]
    assert low == pytest.approx(0.0 - q * sd * math.sqrt(1.25)) and high == pytest.approx(
        4.0 + q * sd * math.sqrt(1.25)
    )
    low, high = limits.branch_bias["mlp"]  # the spread below one noise unit: one unit
    assert low == pytest.approx(-2.0 - q * math.sqrt(1.25)) and high == pytest.approx(0.0 + q * math.sqrt(1.25))
    without = Envelope(env.noise_ratio, env.token_noise_ratio, env.contribution_bias, env.golden_bias).limits(1e-3)
    assert limits.bias_high > without.bias_high  # the rate is shared with the branches
    assert "branch_bias_self_attn in [" in limits.describe()


@pytest.mark.parametrize(
    "broken",
    [
        {"branch_bias": {"mlp": [1.0, 2.0]}, "golden_branch_bias": {"mlp": 0.0}},
        {"branch_bias": {"mlp": [1.0, 2.0, 3.0, float("inf")]}, "golden_branch_bias": {"mlp": 0.0}},
        {"branch_bias": {"mlp": [1.0, 2.0, 3.0, 4.0]}, "golden_branch_bias": {}},
        {"branch_bias": ["mlp"], "golden_branch_bias": {}},
    ],
)
def test_malformed_branches_are_refused(broken):
    data = {**envelope_with_branches().as_metadata(), **broken}
    with pytest.raises(ValueError, match="envelope"):
        Envelope.from_metadata(data)


def test_the_judge_fails_a_target_off_along_one_branch_and_names_it():
    x, ref, golden = layer_like(noise=1e-3)
    attention = branch(ref.shape, 1)
    tensors = {"output": golden, "floor.output": ref, BRANCH_PREFIX + "self_attn": attention}
    assert set(branch_directions(tensors)) == {"self_attn"}
    settings = make_settings()
    ok = judge_golden(0, tensors, "output", golden, {}, settings, "float32", hidden_in=x)
    off = judge_golden(0, tensors, "output", golden + 3e-4 * attention, {}, settings, "float32", hidden_in=x)
    assert ok.passed
    failed = {c.name for c in off.checks if not c.ok}
    assert "branch_bias_self_attn" in failed
    # without an envelope the fixed limit holds, around the golden's own bias
    check = next(c for c in off.checks if c.name == "branch_bias_self_attn")
    assert check.limit - check.low == pytest.approx(12.0)
    # the same through judge() with the branches given, and none without them
    plain = judge(0, golden, golden + 3e-4 * attention, settings, "float32", floor=ref, hidden_in=x)
    assert not any(c.name.startswith("branch_bias") for c in plain.checks)


def _swap_golden(size_in_noise_units: float, seed: int = 4):
    """A golden whose ``gelu_form`` direction stores a move that reads ``size_in_noise_units``
    (the swap, as a port with it reads), and that move (float64)."""
    x, ref, golden = layer_like(noise=1e-3)
    v = branch(ref.shape, seed)
    scale = ref.numel() ** 0.5 / float((golden - ref).norm())
    size = size_in_noise_units / (float(v.norm()) * scale)
    tensors = {
        "output": golden,
        "floor.output": ref,
        BRANCH_PREFIX + "gelu_form": v,
        MOVE_PREFIX + "gelu_form": torch.tensor(size, dtype=torch.float32),
    }
    return x, ref, golden, tensors, size * v


def test_a_stored_move_reads_as_a_port_with_that_bug_reads():
    """The move's size (``floor.move.*``, a multiple of the stored direction) is read in noise
    units; a target off the floor by exactly the move reads that along the direction."""
    x, ref, golden, tensors, move = _swap_golden(100.0)
    assert branch_moves(tensors) == {"gelu_form": pytest.approx(float(tensors[MOVE_PREFIX + "gelu_form"]))}
    assert set(branch_directions(tensors)) == {"gelu_form"}  # the size is no direction
    directions, moves = branch_directions(tensors), branch_moves(tensors)
    stats = floor_stats(golden, ref + move, ref, x, directions=directions, moves=moves)
    assert stats.branch_move["gelu_form"] == pytest.approx(100.0, rel=1e-5)
    assert stats.branch_bias["gelu_form"] == pytest.approx(stats.branch_move["gelu_form"], rel=1e-5)
    assert floor_stats(golden, golden, ref, x, directions=directions).branch_move == {}  # none given


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_kernels_lean_along_gelus_other_form_passes_and_the_swap_fails(dtype):
    """Without an envelope: the fixed range around the golden's bias, widened on each side by
    the dtype's share of the swap (``KERNEL_LEAN``). A port leaning a fifth of the swap
    passes, the whole swap fails; the leaning port fails where the golden stores no move."""
    from pytest_layerparity.compare.verdict import DEFAULT_KERNEL_LEAN, KERNEL_LEAN

    x, _, golden, tensors, move = _swap_golden(100.0)
    settings = make_settings()

    def check(target, held=tensors):
        outcome = judge_golden(0, held, "output", target, {}, settings, dtype, hidden_in=x)
        return next(c for c in outcome.checks if c.name == "branch_bias_gelu_form")

    leaning, swapped = check(golden + 0.2 * move), check(golden + move)
    assert leaning.ok and not swapped.ok
    share = KERNEL_LEAN.get(dtype, DEFAULT_KERNEL_LEAN)
    assert leaning.limit - leaning.low == pytest.approx(2 * (6.0 + share * 100.0), rel=1e-4)
    without = {k: v for k, v in tensors.items() if not k.startswith(MOVE_PREFIX)}
    assert not check(golden + 0.2 * move, without).ok  # 20 noise units against the fixed 6


@pytest.mark.parametrize(("dtype", "size"), [("bfloat16", 100.0), ("float16", 5.0)])
def test_no_check_along_a_move_that_a_port_with_its_bug_would_pass(dtype, size):
    """In bfloat16 correct kernels lean further than the swap goes, and a swap of a few noise
    units stays within the fixed range in any dtype: a port with the swap would pass, so a
    check along it could only fail correct ports. None is made (other statistics may fail
    it); the statistic is still measured."""
    x, _, golden, tensors, move = _swap_golden(size)
    outcome = judge_golden(0, tensors, "output", golden + move, {}, make_settings(), dtype, hidden_in=x)
    assert not any(c.name == "branch_bias_gelu_form" for c in outcome.checks)
    stats = outcome.floor
    assert stats.branch_bias["gelu_form"] == pytest.approx(stats.golden_branch_z["gelu_form"] + size, rel=1e-4)


def test_an_envelopes_branch_range_widens_by_the_lean_given_and_says_so():
    from pytest_layerparity.report.properties import properties

    env = envelope_with_branches()
    plain, leaning = env.limits(1e-3), env.limits(1e-3, {"mlp": 5.0, "absent": 9.0})
    low, high = plain.branch_bias["mlp"]
    assert leaning.branch_bias["mlp"] == pytest.approx((low - 5.0, high + 5.0))
    assert leaning.branch_bias["self_attn"] == plain.branch_bias["self_attn"]
    assert leaning.lean == {"mlp": 5.0}  # a branch the envelope lacks is no range
    assert "a kernel's lean 5 each side" in leaning.describe() and "lean" not in plain.describe()
    # through the judge: the golden's move widens its envelope's range, and JUnit carries it
    x, _, golden, tensors, move = _swap_golden(100.0)
    held = Envelope(
        env.noise_ratio,
        env.token_noise_ratio,
        env.contribution_bias,
        env.golden_bias,
        branch_bias={"gelu_form": (0.5, -0.5, 1.0, 0.0)},
        golden_branch_bias={"gelu_form": 0.0},
    )
    outcome = judge_golden(
        0, tensors, "output", golden + 0.2 * move, {}, make_settings(), "float16", hidden_in=x, envelope=held
    )
    assert outcome.envelope.lean == {"gelu_form": pytest.approx(30.0, rel=1e-4)}
    check = next(c for c in outcome.checks if c.name == "branch_bias_gelu_form")
    assert check.ok and (check.low, check.limit) == outcome.envelope.branch_bias["gelu_form"]
    props = dict(properties(outcome))
    assert (props["branch_bias_gelu_form_low"], props["branch_bias_gelu_form_high"]) == (check.low, check.limit)
    assert props["branch_move_gelu_form"] == pytest.approx(100.0, rel=1e-5)  # what a swapped port reads
    swapped = judge_golden(
        0, tensors, "output", golden + move, {}, make_settings(), "float16", hidden_in=x, envelope=held
    )
    assert not swapped.passed


class _Layer(torch.nn.Module):
    """A layer whose MLP's output gets the residual added in place, as some layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = torch.nn.LayerNorm(8)
        self.self_attn = torch.nn.Linear(8, 8)
        self.mlp = torch.nn.Linear(8, 8)
        self.twice = torch.nn.Linear(8, 8)
        self.act = torch.nn.GELU()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h))
        h = h + self.twice(self.twice(h))
        out = self.mlp(self.act(h))
        out += h
        return out


def test_the_floors_pass_keeps_each_branch_once_called_and_not_the_norms():
    layer, out = _Layer(), {}
    x = torch.randn(3, 8)
    with torch.no_grad(), capture_branches(layer, out):
        layer(x)
    assert set(out) == {"self_attn", "mlp"}  # the norm, the parameter-free GELU and the twice-called child left out
    torch.testing.assert_close(out["self_attn"], layer.self_attn(layer.input_layernorm(x)).detach())
    with torch.no_grad():
        h = x + layer.self_attn(layer.input_layernorm(x))
        h = h + layer.twice(layer.twice(h))
        torch.testing.assert_close(out["mlp"], layer.mlp(layer.act(h)))  # the branch, not the sum
    with torch.no_grad():
        layer(x)
    assert not layer.self_attn._forward_hooks  # the hooks go with the context


def test_junit_carries_each_branchs_bias_and_range():
    from pytest_layerparity.report.properties import properties

    x, ref, golden = layer_like(noise=1e-3)
    attention = branch(ref.shape, 1)
    tensors = {"output": golden, "floor.output": ref, BRANCH_PREFIX + "self_attn": attention}
    outcome = judge_golden(
        0, tensors, "output", golden, {}, make_settings(), "float32", hidden_in=x, envelope=envelope_with_branches()
    )
    props = dict(properties(outcome))
    assert props["branch_bias_self_attn"] == pytest.approx(outcome.floor.branch_bias["self_attn"])
    low, high = outcome.envelope.branch_bias["self_attn"]
    assert (props["branch_bias_self_attn_low"], props["branch_bias_self_attn_high"]) == (low, high)
    assert "branch_bias_mlp_low" in props  # the envelope's branch, though this golden holds no mlp output


def test_a_branch_counts_where_it_is_part_of_the_contribution_and_not_the_output_itself():
    from pytest_layerparity.noise.wide_pass import contribution_branches

    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 16, generator=g, dtype=torch.float64)
    attention = torch.randn(4, 16, generator=g, dtype=torch.float64)
    mlp = torch.randn(4, 16, generator=g, dtype=torch.float64)
    out = x + attention + mlp
    state = torch.randn(4, 16, generator=g, dtype=torch.float64)  # a normalised state, not a contribution
    kept = contribution_branches({"attn": attention, "mlp": mlp, "state": state, "output": out}, out, x)
    assert set(kept) == {"attn", "mlp"}
    assert contribution_branches({"attn": attention}, out, None) == {}  # without the input: none
    assert contribution_branches({"attn": attention[:2]}, out, x) == {}  # another shape: none


def test_the_suggested_contribution_limit_passes_every_branch_too():
    import re

    from pytest_layerparity.report.text import failure_text

    x, ref, golden = layer_like(noise=1e-3)
    attention = branch(ref.shape, 1)
    tensors = {"output": golden, "floor.output": ref, BRANCH_PREFIX + "self_attn": attention}
    target = golden + 3e-4 * attention
    outcome = judge_golden(0, tensors, "output", target, {}, make_settings(), "float32", hidden_in=x)
    z = float(
        re.search(r"layerparity_max_contribution_z=([0-9.e+]+)", failure_text(outcome, "on cpu", "next")).group(1)
    )
    stats = outcome.floor
    assert z == pytest.approx(max(abs(stats.contribution_z), abs(stats.branch_z["self_attn"])), rel=1e-2)
    again = judge_golden(
        0, tensors, "output", target, {}, make_settings(max_contribution_z=z * 1.01), "float32", hidden_in=x
    )
    assert all(c.ok for c in again.checks if "bias" in c.name)


def test_a_chains_floor_step_gives_the_same_output_without_the_extras():
    """FloorEvaluator.evaluate(extras=False) (a chain's floor step) computes the same output
    and captures nothing beside it; with them, the routers and branches are there."""
    from pathlib import Path

    from pytest_layerparity.model.source import ModelSource
    from pytest_layerparity.noise.wide_pass import FloorEvaluator
    from pytest_layerparity.store.golden import GoldenStore

    fixtures = Path(__file__).resolve().parents[2] / "fixtures"
    entry = GoldenStore(fixtures / "goldens" / "minimax_m2_tiny").load("layer_1")
    floor = FloorEvaluator(ModelSource(fixtures / "minimax_m2_tiny"), torch.bfloat16)
    spec = entry.metadata["call"]
    out, found = floor.evaluate(1, spec, entry.tensors)
    bare, nothing = floor.evaluate(1, spec, entry.tensors, extras=False)
    assert nothing == {}
    assert any(k.startswith("floor.branch.") for k in found) and any(k.startswith("floor.routing.") for k in found)
    assert torch.equal(out, bare)


def test_softer_attention_scales_every_attentions_scores_and_no_routers():
    from pytest_layerparity.noise.directions import SofterAttention

    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with SofterAttention(0.5) as softer:
        default = sdpa(q, k, v, is_causal=True)
        given = sdpa(q, k, v, is_causal=True, scale=0.25)
        scores = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        router = torch.nn.functional.softmax(q[0, 0], dim=-1)  # tokens x experts: left as it is
    torch.testing.assert_close(default, sdpa(q, k, v, is_causal=True, scale=0.5 / math.sqrt(8)))
    torch.testing.assert_close(given, sdpa(q, k, v, is_causal=True, scale=0.125))
    torch.testing.assert_close(scores, torch.softmax(0.5 * (q @ k.transpose(-1, -2)), dim=-1))
    torch.testing.assert_close(router, torch.softmax(q[0, 0], dim=-1))
    assert softer.hits == 3


def test_the_floors_pass_finds_the_attention_temperatures_direction_on_prompts_and_decode_steps():
    """Along it lies what a port with its attention's temperature off does (the embedded
    MiniMax-M2 layer, its scores scaled by 1.01: the effect's cosine with the stored
    direction; at 1.05 its router picks other experts for a token, which the routing checks
    judge), on the prompt and on a decode step, whose appended keys stay the first pass's."""
    from pathlib import Path

    from pytest_layerparity.model.source import ModelSource
    from pytest_layerparity.noise.directions import TEMPERATURE_BRANCH, SofterAttention, temperature_direction
    from pytest_layerparity.noise.wide_pass import FLOOR_NEW_KEYS, FloorEvaluator
    from pytest_layerparity.store.golden import GoldenStore

    fixtures = Path(__file__).resolve().parents[2] / "fixtures"
    store = GoldenStore(fixtures / "goldens" / "minimax_m2_tiny")
    floor = FloorEvaluator(ModelSource(fixtures / "minimax_m2_tiny"), torch.bfloat16)
    for key in ("layer_1", "layer_1.decode_0"):
        entry = store.load(key)
        spec = entry.metadata["call"]
        out, found = floor.evaluate(1, spec, entry.tensors)
        direction = found[BRANCH_PREFIX + TEMPERATURE_BRANCH].double().flatten()
        with SofterAttention(1.01):
            sharper, _ = floor.evaluate(1, spec, entry.tensors, extras=False)
        effect = (sharper.double() - out.double()).flatten()
        cosine = float(effect @ direction) / float(effect.norm() * direction.norm())
        assert cosine < -0.99  # sharper is the other way from softer
        if key.endswith("decode_0"):
            torch.testing.assert_close(found[FLOOR_NEW_KEYS], entry.tensors[FLOOR_NEW_KEYS].to(found[FLOOR_NEW_KEYS]))
    mlp = torch.nn.Linear(8, 8)
    x = torch.randn(3, 8)
    assert temperature_direction(lambda: mlp(x), mlp(x), 0.95) is None  # no attention: no direction


def test_raised_norm_epsilon_raises_every_norms_epsilon_in_the_layer_and_puts_it_back():
    from pytest_layerparity.noise.directions import raised_norm_epsilon

    class RMSNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.variance_epsilon = 1e-6

    layer = torch.nn.Module()
    layer.input_layernorm = RMSNorm()
    layer.attn = torch.nn.Module()
    layer.attn.q_norm = torch.nn.LayerNorm(4, eps=1e-5)  # nested: raised too
    layer.attn.proj = torch.nn.Linear(4, 4)
    layer.final_norm = torch.nn.RMSNorm(4)  # its eps None: torch's default, left alone
    with raised_norm_epsilon(layer, 0.5) as norms:
        assert norms == 2
        assert layer.input_layernorm.variance_epsilon == 0.5 + 1e-6 and layer.attn.q_norm.eps == 0.5 + 1e-5
        assert layer.final_norm.eps is None
    assert layer.input_layernorm.variance_epsilon == 1e-6 and layer.attn.q_norm.eps == 1e-5


def test_the_floors_pass_finds_the_norms_epsilon_direction_on_prompts_and_decode_steps():
    """Along it lies what a port that reads another epsilon for the layer's norms does (the
    embedded MiniMax-M2 layer, every norm's epsilon 1e-2 where the model's is 1e-6: the
    effect's cosine with the stored direction), on the prompt and on a decode step; a layer
    without norms has none."""
    from pathlib import Path

    from pytest_layerparity.model.source import ModelSource
    from pytest_layerparity.noise.directions import NORM_EPSILON_BRANCH, norm_epsilon_direction
    from pytest_layerparity.noise.wide_pass import FloorEvaluator
    from pytest_layerparity.store.golden import GoldenStore

    fixtures = Path(__file__).resolve().parents[2] / "fixtures"
    store = GoldenStore(fixtures / "goldens" / "minimax_m2_tiny")
    floor = FloorEvaluator(ModelSource(fixtures / "minimax_m2_tiny"), torch.bfloat16)
    layer = floor.load(1)
    for key in ("layer_1", "layer_1.decode_0"):
        entry = store.load(key)
        spec = entry.metadata["call"]
        out, found = floor.evaluate(1, spec, entry.tensors, layer=layer)
        direction = found[BRANCH_PREFIX + NORM_EPSILON_BRANCH].double().flatten()
        norms = [m for m in layer.modules() if hasattr(m, "variance_epsilon")]
        assert len(norms) >= 2 and all(m.variance_epsilon == 1e-6 for m in norms)  # put back
        for m in norms:
            m.variance_epsilon = 1e-2
        wrong, _ = floor.evaluate(1, spec, entry.tensors, layer=layer, extras=False)
        for m in norms:
            m.variance_epsilon = 1e-6
        effect = (wrong.double() - out.double()).flatten()
        assert float(effect @ direction) / float(effect.norm() * direction.norm()) > 0.99  # raised, as the step
    mlp = torch.nn.Linear(8, 8)
    x = torch.randn(3, 8)
    assert norm_epsilon_direction(mlp, x, lambda: mlp(x), mlp(x), 0.95) is None


def test_other_gelu_form_swaps_each_gelu_and_gives_each_its_forward_back():
    """erf's GELU computes the tanh approximation and the approximation erf's while active (torch's
    GELU and transformers' activations alike); afterwards each module computes its own form
    again, and a forward an instance had of its own (a hook's) is the one it gets back."""
    from transformers.activations import ACT2FN

    from pytest_layerparity.noise.directions import other_gelu_form

    x = torch.linspace(-4, 4, 101, dtype=torch.float64)
    erf, tanh = torch.nn.functional.gelu(x), torch.nn.functional.gelu(x, approximate="tanh")
    layer = torch.nn.Module()
    layer.a, layer.b, layer.c = ACT2FN["gelu"], ACT2FN["gelu_new"], torch.nn.GELU(approximate="tanh")
    layer.d = torch.nn.SiLU()
    hooked = torch.nn.GELU()
    hooked.forward = lambda v: torch.nn.functional.gelu(v) + 1  # as a hook wraps it
    layer.e = hooked
    with other_gelu_form(layer) as swapped:
        assert swapped == 4
        torch.testing.assert_close(layer.a(x), tanh)
        torch.testing.assert_close(layer.b(x), erf)
        torch.testing.assert_close(layer.c(x), erf)
        torch.testing.assert_close(layer.e(x), tanh)
    torch.testing.assert_close(layer.a(x), erf)
    torch.testing.assert_close(layer.b(x), tanh, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(layer.c(x), tanh)
    torch.testing.assert_close(layer.e(x), erf + 1)
    assert "forward" not in layer.a.__dict__


def test_the_gelu_form_direction_is_what_reading_the_other_hidden_act_does():
    """Along it lies what a port that computes the other GELU form does (an MLP with erf's GELU
    read as the tanh approximation), and the size it comes with is that port's move; an MLP
    without GELU has none."""
    from transformers.activations import ACT2FN

    from pytest_layerparity.noise.directions import gelu_form_direction

    g = torch.Generator().manual_seed(3)
    up, down = torch.nn.Linear(16, 64).double(), torch.nn.Linear(64, 16).double()
    x = 3 * torch.randn(32, 16, generator=g, dtype=torch.float64)
    mlp = torch.nn.Sequential(up, ACT2FN["gelu"], down).requires_grad_(False)
    out = mlp(x)
    found = gelu_form_direction(mlp, lambda: mlp(x), out, 0.95)
    effect = (torch.nn.Sequential(up, ACT2FN["gelu_pytorch_tanh"], down)(x) - out).flatten()
    assert found is not None
    direction, size = found
    assert direction.norm() == pytest.approx(float(out.norm()))
    assert float(effect @ direction.flatten()) / float(effect.norm() * direction.norm()) > 0.999
    assert size * float(direction.norm()) == pytest.approx(float(effect.norm()), rel=1e-9)
    assert 0 < size < 1e-2  # the forms differ by a small fraction of the output
    silu = torch.nn.Sequential(up, torch.nn.SiLU(), down)
    assert gelu_form_direction(silu, lambda: silu(x), silu(x), 0.95) is None
