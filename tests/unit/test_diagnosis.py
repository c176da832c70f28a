"""The diagnosis line of a failing test: the part whose stored direction explains its error,
the keys and values it wrote, the routers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pytest_layerparity.compare.diagnosis import PARTS, diagnose
from pytest_layerparity.compare.judge import judge
from pytest_layerparity.compare.parts import direction_part
from pytest_layerparity.compare.routing import RoutingAgreement
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
