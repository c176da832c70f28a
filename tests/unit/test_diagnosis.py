"""The diagnosis line of a failing test: the part whose stored direction explains its error,
the keys and values it wrote, the routers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pytest_layerparity.compare.diagnosis import PARTS, diagnose
from pytest_layerparity.compare.judge import judge
from pytest_layerparity.compare.parts import direction_part
from pytest_layerparity.compare.routing_agreement import RoutingAgreement
from pytest_layerparity.compare.shares import error_shares
from pytest_layerparity.compare.verdict import Check
from pytest_layerparity.options import make_settings
from pytest_layerparity.report.properties import properties
from pytest_layerparity.report.text import failure_text


def layer(tokens: int = 16, width: int = 32):
    """A floor, its bfloat16 golden, and three directions: two branches' outputs and the
    attention temperature's effect (random, so nearly orthogonal)."""
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(tokens, width, generator=g, dtype=torch.float64)
    directions = {
        "self_attn": torch.randn(tokens, width, generator=g),
        "mlp": torch.randn(tokens, width, generator=g),
        "attention_temperature": torch.randn(tokens, width, generator=g),
    }
    return ref, ref.to(torch.bfloat16), directions


@pytest.mark.parametrize(
    ("direction", "part"), [("self_attn", "attention"), ("mlp", "mlp"), ("attention_temperature", "scores")]
)
def test_an_error_along_one_stored_direction_names_its_part_surely(direction, part):
    ref, golden, directions = layer()
    target = (ref + 0.3 * directions[direction].double()).to(torch.bfloat16)
    outcome = judge(0, golden, target, make_settings(), "bfloat16", floor=ref.float(), branches=directions)
    assert not outcome.passed
    found = diagnose(outcome)
    assert found.part == part and found.sureness == "sure"
    assert f"{direction} explains" in found.evidence
    assert dict(properties(outcome))["diagnosis"] == part
    assert f"  diagnosis: {PARTS[part]} (sure: {direction} explains" in failure_text(outcome, "on cpu", "rerun")


def test_an_error_of_another_form_is_a_guess_naming_the_closest_part():
    ref, golden, directions = layer()
    other = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    target = (ref + 0.3 * other + 0.15 * directions["mlp"].double()).to(torch.bfloat16)
    outcome = judge(0, golden, target, make_settings(), "bfloat16", floor=ref.float(), branches=directions)
    found = diagnose(outcome)
    assert found.part == "mlp" and found.sureness == "a guess"


def test_the_cache_and_the_routers_come_before_the_output_direction():
    ref, golden, directions = layer()
    target = (ref + 0.3 * directions["mlp"].double()).to(torch.bfloat16)
    outcome = judge(0, golden, target, make_settings(), "bfloat16", floor=ref.float(), branches=directions)
    keys_only = dataclasses.replace(
        outcome, checks=[*outcome.checks, Check("prompt_keys_noise_ratio", 40, "<=", 2, False)]
    )
    assert diagnose(keys_only).part == "positions"
    both = [
        Check("prompt_keys_noise_ratio", 40, "<=", 2, False),
        Check("prompt_values_noise_ratio", 30, "<=", 2, False),
    ]
    assert diagnose(dataclasses.replace(outcome, checks=[*outcome.checks, *both])).part == "mlp"  # explained
    unexplained = dataclasses.replace(outcome, checks=[*outcome.checks, *both], error_shares={"mlp": 0.1})
    assert diagnose(unexplained).part == "kv"
    scaled = dataclasses.replace(unexplained, kv_self_shares={"values": 0.95})  # the values, scaled: their input
    assert diagnose(scaled).part == "norm"
    mixed = dataclasses.replace(unexplained, kv_self_shares={"values": 0.5})  # replaced by unrelated values
    assert diagnose(mixed).part == "kv"
    flips = RoutingAgreement("mlp.gate", 16, 0.5, 8, 0, tuple(range(8)), ())
    routed = dataclasses.replace(outcome, routing=[flips], error_shares={"mlp": 0.05})
    assert diagnose(routed).part == "router"
    assert diagnose(dataclasses.replace(outcome, routing=[flips])).part == "mlp"  # its output, scaled: the MLP's
    near_ties = RoutingAgreement("mlp.gate", 16, 0.5, 8, 8, tuple(range(8)), tuple(range(8)))
    assert diagnose(dataclasses.replace(routed, routing=[near_ties])).part == "unclear"  # near ties: no evidence


def test_an_error_no_direction_explains_is_said_to_be_unclear():
    ref, golden, directions = layer()
    outcome = judge(0, golden, golden.clone(), make_settings(), "bfloat16", floor=ref.float(), branches=directions)
    failing = dataclasses.replace(
        outcome, checks=[Check("noise_ratio", 9, "<=", 2, False)], error_shares={"mlp": 0.04, "self_attn": 0.02}
    )
    found = diagnose(failing)
    assert found.part == "unclear"
    assert found.describe() == "diagnosis: no part stands out (no stored direction explains it (largest: mlp, 4%))"


def test_shares_and_parts():
    ref, golden, directions = layer()
    shares = error_shares(golden, golden.float() + directions["mlp"], directions, None)
    assert shares["mlp"] == pytest.approx(1.0, abs=1e-3) and shares["self_attn"] < 0.1
    assert [direction_part(n) for n in ("self_attn", "attention", "block_sparse_moe", "norm_epsilon", "x")] == [
        "attention",
        "attention",
        "mlp",
        "norm",
        None,
    ]
    passing = judge(0, golden, golden.clone(), make_settings(), "bfloat16", floor=ref.float(), branches=directions)
    assert diagnose(passing) is None and "diagnosis" not in dict(properties(passing))


def test_a_norms_weight_is_named_only_where_it_explains_surely_and_more_than_any_other():
    ref, golden, directions = layer()
    outcome = judge(0, golden, golden.clone(), make_settings(), "bfloat16", floor=ref.float(), branches=directions)
    failing = dataclasses.replace(outcome, checks=[Check("noise_ratio", 9, "<=", 2, False)])

    def named(shares):
        return diagnose(dataclasses.replace(failing, error_shares=shares)).part

    weight = "norm_weight.post_attention_layernorm"
    assert named({"mlp": 0.85, weight: 0.92}) == "norm"
    assert named({"mlp": 0.91, weight: 0.915}) == "mlp"  # within the margin: the branch's own output
    assert named({"mlp": 0.2, weight: 0.35}) == "mlp"  # an error inside the MLP leans on its input too
    assert named({weight: 0.3, "mlp": 0.05}) == "unclear"  # never a norm's weight as a guess
    assert named({"norm_bias": 0.95, "self_attn": 0.4}) == "norm"
    assert direction_part("norm_weight.self_attn.q_norm") == "norm"


def judged_against_the_floor(index, out, wrong, found):
    """A bfloat16 test of ``wrong`` against the floor's output ``out`` rounded, with what the
    floor's pass ``found`` (its branches, its moves for the diagnosis, its heads)."""
    from pytest_layerparity.compare.floor import HEADS_KEY, branch_directions, cause_directions

    return judge(
        index,
        out.to(torch.bfloat16),
        wrong.to(torch.bfloat16),
        make_settings(),
        "bfloat16",
        floor=out,
        branches=branch_directions(found),
        causes=cause_directions(found),
        heads=found.get(HEADS_KEY),
    )


def test_a_wrong_post_attention_norm_weight_reads_as_the_norm_and_a_scaled_mlp_as_the_mlp():
    """On the embedded MiniMax-M2's layer 1 (its floor's pass): the post-attention norm's weight
    read as (1 + w) and the MLP's output 25% high each move the output along the MLP's output,
    and the norm's stored weight move tells them apart."""
    from pathlib import Path

    from pytest_layerparity.compare.floor import BRANCH_PREFIX, CAUSE_PREFIX
    from pytest_layerparity.model.source import ModelSource
    from pytest_layerparity.noise.directions import scaled_output
    from pytest_layerparity.noise.wide_pass import FloorEvaluator
    from pytest_layerparity.store.golden import GoldenStore

    fixtures = Path(__file__).resolve().parents[2] / "fixtures"
    entry = GoldenStore(fixtures / "goldens" / "minimax_m2_tiny").load("layer_1")
    floor = FloorEvaluator(ModelSource(fixtures / "minimax_m2_tiny"), torch.bfloat16)
    one = floor.load(1)
    spec = entry.metadata["call"]
    out, found = floor.evaluate(1, spec, entry.tensors, layer=one)
    assert {CAUSE_PREFIX + "norm_weight.input_layernorm", CAUSE_PREFIX + "norm_weight.post_attention_layernorm"} <= set(
        found
    )
    assert CAUSE_PREFIX + "norm_bias" not in found  # RMSNorms: no bias
    assert CAUSE_PREFIX + "norm_weight.self_attn.q_norm" not in found  # the scores' scale: the temperature's move
    assert BRANCH_PREFIX + "mlp" in found
    norm = one.post_attention_layernorm
    with torch.no_grad():
        norm.weight.add_(1.0)
    wrong_norm, _ = floor.evaluate(1, spec, entry.tensors, layer=one, extras=False)
    with torch.no_grad():
        norm.weight.sub_(1.0)
    with scaled_output(one.mlp, 1.25):
        wrong_mlp, _ = floor.evaluate(1, spec, entry.tensors, layer=one, extras=False)
    for wrong, part in ((wrong_norm, "norm"), (wrong_mlp, "mlp")):
        outcome = judged_against_the_floor(1, out, wrong, found)
        assert diagnose(outcome).part == part, (part, outcome.error_shares)


def test_the_norms_bias_move_is_what_a_dropped_layernorm_bias_does_and_the_bias_is_put_back():
    from pytest_layerparity.noise.directions import norm_bias_direction, norm_weight_directions

    g = torch.Generator().manual_seed(5)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = torch.nn.LayerNorm(16).double()
            self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(), torch.nn.Linear(48, 16)).double()
            self.final_norm = torch.nn.LayerNorm(16).double()

        def forward(self, x):
            return self.final_norm(x + self.mlp(self.input_layernorm(x)))

    block = Block().requires_grad_(False)
    with torch.no_grad():
        for norm in (block.input_layernorm, block.final_norm):
            norm.bias.copy_(0.5 * torch.randn(16, generator=g, dtype=torch.float64))
    x = 2 * torch.randn(24, 16, generator=g, dtype=torch.float64)
    out = block(x)
    biases = [block.input_layernorm.bias.clone(), block.final_norm.bias.clone()]
    direction = norm_bias_direction(block, lambda: block(x), out, 0.95)
    assert torch.equal(block.input_layernorm.bias, biases[0]) and torch.equal(block.final_norm.bias, biases[1])
    weights = norm_weight_directions(block, lambda: block(x), out, 0.95)
    assert set(weights) == {"norm_weight.input_layernorm"}  # the last norm's move is the output's own scale
    with torch.no_grad():
        block.input_layernorm.bias.zero_()
        block.final_norm.bias.zero_()
    effect = (block(x) - out).flatten()
    assert float(effect @ direction.flatten()) ** 2 / float(effect.norm() * direction.norm()) ** 2 > 0.9
    assert norm_bias_direction(block.mlp, lambda: block.mlp(x), block.mlp(x), 0.95) is None


def test_written_values_scaled_token_by_token_read_as_scaled_and_mixed_heads_do_not():
    from pytest_layerparity.compare.shares import self_share

    g = torch.Generator().manual_seed(2)
    values = torch.randn(1, 4, 12, 8, generator=g, dtype=torch.float64)  # (batch, heads, tokens, head width)
    per_token = 1 + 0.05 * torch.randn(1, 1, 12, 1, generator=g, dtype=torch.float64)  # a norm's factor
    assert self_share(values, values * per_token) == pytest.approx(1.0)
    assert self_share(values, values * 1.1) == pytest.approx(1.0)
    per_head = 1 + 0.05 * torch.randn(1, 4, 1, 1, generator=g, dtype=torch.float64)  # not one factor per token
    assert self_share(values, values * per_head) < 0.9
    mixed = values[:, [1, 0, 2, 3]]  # two heads' values swapped
    assert 0.2 < self_share(values, mixed) < 0.8
    assert self_share(values, values + torch.randn(values.shape, generator=g, dtype=torch.float64)) < 0.1
    assert self_share(values, values) is None and self_share(values, values[:, :2]) is None


def test_a_post_norm_encoders_nested_attention_gets_a_move_of_its_own_and_redundant_moves_are_dropped():
    """A BERT layer's attention branch ends in its norm; the self-attention inside it is the
    one nested attention, and a projection of its read wrong moves the output partly along
    its move. A move along a stored direction is not kept."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    from pytest_layerparity.noise.directions import distinct_moves, inner_attention_directions

    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0)
    bert = BertLayer(config).double().eval().requires_grad_(False)
    x = torch.randn(1, 12, 32, dtype=torch.float64)

    def run():
        return bert(x)[0]

    out = run()
    moves = inner_attention_directions(bert, run, out, 0.95)
    assert set(moves) == {"inner_attention.attention.self"}
    with torch.no_grad():
        bert.attention.self.value.weight.copy_(bert.attention.self.value.weight.t().clone())
    effect = (run() - out).flatten()
    direction = moves["inner_attention.attention.self"].flatten()
    assert float(effect @ direction) ** 2 / float(effect.norm() * direction.norm()) ** 2 > 0.1
    other = torch.randn(out.shape, dtype=torch.float64)
    assert set(distinct_moves({"same": -2 * other, "own": out}, [other])) == {"own"}


def test_sketches_estimate_shares_and_a_tensor_within_the_size_is_kept_whole():
    from pytest_layerparity.compare.sketch import SKETCH_SIZE, head_shares, sketch, unit_sketches

    g = torch.Generator().manual_seed(4)
    small = torch.randn(1, 8, 64, generator=g, dtype=torch.float64)
    assert torch.equal(sketch(small), small.flatten())
    golden = torch.randn(1, 256, 96, generator=g, dtype=torch.float64)  # 24,576 elements: sketched
    heads = [torch.randn(golden.shape, generator=g, dtype=torch.float64) for _ in range(6)]
    sketches = unit_sketches(heads).to(torch.bfloat16)  # as a bfloat16 golden keeps them
    assert sketches.shape == (6, SKETCH_SIZE)
    torch.testing.assert_close(sketches.double().norm(dim=1), torch.ones(6, dtype=torch.float64), rtol=0.01, atol=0)
    assert torch.equal(sketch(heads[0]), sketch(heads[0]))  # the same buckets every time
    target = golden - 0.5 * heads[2] + 0.2 * torch.randn(golden.shape, generator=g, dtype=torch.float64)
    exact = error_shares(golden, target, {f"h{i}": h for i, h in enumerate(heads)}, None)
    found = head_shares(golden, target, sketches, None)
    for i in range(6):
        assert found[f"attention_head.{i}"] == pytest.approx(exact[f"h{i}"], abs=0.05)
    assert found["attention_head.2"] > 0.8
    keep = torch.ones(256, dtype=torch.bool)
    keep[:128] = False  # the error on left-out tokens does not count
    elsewhere = golden.clone()
    elsewhere[0, :128] += 5 * heads[4][0, :128]
    assert max(head_shares(golden, elsewhere + 1e-3 * heads[1], sketches, keep).values()) == pytest.approx(
        head_shares(golden, elsewhere + 1e-3 * heads[1], sketches, keep)["attention_head.1"]
    )
    assert head_shares(golden, target, sketches[:, :100], None) == {}  # another size: none
    assert head_shares(golden, target, None, None) == {}


def test_each_heads_part_is_what_dropping_that_head_takes_away_and_it_is_named_when_likely():
    """The embedded MiniMax-M2's layer 3: the floor's pass keeps each head's part of the output,
    summed they are the attention's projection without its bias; a port that drops one head's
    output fails with that head named."""
    from pathlib import Path

    from pytest_layerparity.compare.floor import HEADS_KEY
    from pytest_layerparity.model.source import ModelSource
    from pytest_layerparity.noise.heads import capture_heads, head_parts
    from pytest_layerparity.noise.wide_pass import FloorEvaluator
    from pytest_layerparity.store.golden import GoldenStore

    fixtures = Path(__file__).resolve().parents[2] / "fixtures"
    entry = GoldenStore(fixtures / "goldens" / "minimax_m2_tiny").load("layer_3")
    floor = FloorEvaluator(ModelSource(fixtures / "minimax_m2_tiny"), torch.bfloat16)
    one = floor.load(3)
    spec = entry.metadata["call"]
    captured: dict = {}
    projected = []
    out, found = floor.evaluate(3, spec, entry.tensors, layer=one)
    handle = one.self_attn.o_proj.register_forward_hook(lambda m, a, o: projected.append(o.detach()))
    with capture_heads(one.self_attn, captured):  # one pass: the one call of the projection
        floor.evaluate(3, spec, entry.tensors, layer=one, extras=False)
    handle.remove()
    parts = head_parts(captured, out.shape)
    heads = one.self_attn.o_proj.in_features // one.self_attn.head_dim
    assert len(parts) == heads == found[HEADS_KEY].shape[0]
    torch.testing.assert_close(sum(parts), projected[0].reshape(out.shape), rtol=1e-5, atol=1e-5)
    width = one.self_attn.head_dim

    def drop(module, args):
        x = args[0].clone()
        x[..., 2 * width : 3 * width] = 0
        return (x, *args[1:])

    handle = one.self_attn.o_proj.register_forward_pre_hook(drop)
    wrong, _ = floor.evaluate(3, spec, entry.tensors, layer=one, extras=False)
    handle.remove()
    outcome = judged_against_the_floor(3, out, wrong, found)
    found_part = diagnose(outcome)
    assert found_part.part == "attention" and "attention_head.2 explains" in found_part.evidence
    named = {"attention_head.3": 0.3, "mlp": 0.2}  # one more direction of the attention
    assert diagnose(dataclasses.replace(outcome, error_shares=named)).part == "attention"


def test_an_attention_with_wider_queries_than_values_is_split_by_its_values_width():
    from pytest_layerparity.noise.heads import head_parts, output_projection

    attention = torch.nn.Module()
    attention.head_dim, attention.v_head_dim = 24, 16  # queries and keys 24 wide, values 16
    attention.o_proj = torch.nn.Linear(4 * 16, 32, bias=False)
    projection, width = output_projection(attention)
    assert projection is attention.o_proj and width == 16
    context = torch.randn(1, 5, 64)
    parts = head_parts({"context": context, "projection": projection, "width": width}, torch.Size((1, 5, 32)))
    assert len(parts) == 4
    torch.testing.assert_close(sum(parts), attention.o_proj(context).detach())
    wrong = {"context": torch.randn(1, 5, 48), "projection": projection, "width": width}  # not its input
    assert head_parts(wrong, torch.Size((1, 5, 32))) == []
