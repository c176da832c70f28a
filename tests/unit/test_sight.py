"""A test's detection limits (compare.sight): the smallest change of each stored kind that the
verdict fails on, found from one pass over the output, held against the verdict run on the
output so changed."""

from __future__ import annotations

import pytest
import torch

from pytest_layerparity.compare.envelope import Envelope
from pytest_layerparity.compare.floor import STEP_PREFIX, branch_moves
from pytest_layerparity.compare.judge import judge
from pytest_layerparity.options import make_settings

TEMPERATURE_STEP = 40.0  # the output's move per unit of the scores' scale, as a multiple of the direction
EPSILON_STEP = 2e-4  # per unit of the epsilon's factor less one
ATTENTION_STEP = 1.1  # the measured move of the attention's scale, per unit, over its stored direction


def layer(tokens: int = 24, width: int = 64, attention_size: float = 0.5, post_norm: bool = False):
    """A layer's input, its floor (input plus an attention and an MLP contribution), a bfloat16
    golden, the branches' outputs, the temperature's and the epsilon's directions (scaled to
    the output's norm, as stored), and a correct port: the floor with another rounding's
    error, in float64 (a move of any size stays exact). ``post_norm``: each branch's output
    normalised per token before it is added (as a post-norm layer adds it)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, width, generator=g, dtype=torch.float64)
    attention = attention_size * torch.randn(tokens, width, generator=g, dtype=torch.float64)
    mlp = 0.7 * torch.randn(tokens, width, generator=g, dtype=torch.float64)
    if post_norm:
        ref = x + sum(b / b.square().mean(-1, keepdim=True).sqrt() for b in (attention, mlp))
    else:
        ref = x + attention + mlp
    size = float(ref.norm())
    directions = {
        "self_attn": attention.to(torch.bfloat16),
        "mlp": mlp.to(torch.bfloat16),
        "attention_temperature": torch.randn(tokens, width, generator=g).mul(size / (tokens * width) ** 0.5),
        "norm_epsilon": torch.randn(tokens, width, generator=g).mul(size / (tokens * width) ** 0.5),
    }
    directions = {k: v.to(torch.bfloat16) for k, v in directions.items()}
    golden = ref.to(torch.bfloat16)
    noise = torch.randn(tokens, width, generator=g, dtype=torch.float64)
    port = ref + noise * float((golden.double() - ref).norm()) / float(noise.norm())
    return x, ref, golden, directions, port


def sights(directions) -> dict:
    """The moves measured at extraction for the limits alone: the attention's scale (its own
    output and what the MLP answers, scaled to the output's norm as stored) and the epsilon's."""
    g = torch.Generator().manual_seed(5)
    answer = 0.3 * torch.randn(directions["self_attn"].shape, generator=g, dtype=torch.float64)
    attention = directions["self_attn"].double() + answer
    return {
        "attention_scale": attention.to(torch.bfloat16),
        "norm_epsilon": torch.randn(directions["mlp"].shape, generator=g).to(torch.bfloat16),
    }


#: A layer's envelope whose runs' ratios were weighed element by element (envelope rule 6).
RELATIVE_RUNS = Envelope(
    (1.0, 1.1, 0.9, 1.05, 0.95, 1.02),
    (1.5, 1.7, 1.4, 1.6, 1.5, 1.45),
    (0.5, -0.5, 0.2, 0.1, 0.0, -0.3),
    0.0,
    relative=True,
)


def judged(golden, target, ref, x, directions, steps=True, measured=False, envelope=None):
    return judge(
        0,
        golden,
        target,
        make_settings(),
        "bfloat16",
        floor=ref.float(),
        hidden_in=x.to(torch.bfloat16),
        branches=directions,
        steps={
            "attention_temperature": TEMPERATURE_STEP,
            "attention_scale": ATTENTION_STEP,
            "norm_epsilon": EPSILON_STEP,
        }
        if steps
        else None,
        sights=sights(directions) if measured else None,
        envelope=envelope,
    )


def moved(kind: str, directions, size: float, measured: bool = False) -> torch.Tensor:
    """What a change of ``kind`` of ``size`` adds to the output (the sight's own model of it)."""
    if measured and kind in ("attention_scale", "norm_epsilon"):
        return (
            size * sights(directions)[kind].double() * (ATTENTION_STEP if kind == "attention_scale" else EPSILON_STEP)
        )
    if kind == "attention_scale":
        return size * directions["self_attn"].double()
    if kind == "mlp_scale":
        return size * directions["mlp"].double()
    # scores scaled up: the other way from the stored softer step
    return -size * TEMPERATURE_STEP * directions["attention_temperature"].double()


@pytest.mark.parametrize(
    ("kind", "measured", "envelope"),
    [
        ("attention_scale", False, None),
        ("attention_scale", True, None),
        ("mlp_scale", False, None),
        ("temperature", False, None),
        ("norm_epsilon", True, None),
        ("attention_scale", True, RELATIVE_RUNS),
        ("mlp_scale", False, RELATIVE_RUNS),
        ("temperature", False, RELATIVE_RUNS),
    ],
)
def test_each_limit_is_where_the_verdict_starts_to_fail(kind, measured, envelope):
    """Just below the stated size the verdict on the changed output passes, just above it
    fails; for a scale or temperature on both sides, for the epsilon (a factor) raised. With
    the moves measured at extraction the attention's scale and the epsilon are taken along
    them; with an envelope whose ratios are relative, in the ratios' weighed units."""
    x, ref, golden, directions, port = layer()
    outcome = judged(golden, port, ref, x, directions, measured=measured, envelope=envelope)
    assert outcome.passed and outcome.sight is not None and outcome.sight.base == "port"
    limit = outcome.sight.by_kind()[kind]
    sides = [limit.high - 1] if kind == "norm_epsilon" else [limit.high, limit.low]
    failing = set()  # each side's first failing check: the limit names one of them
    for size in sides:
        assert size is not None
        below = port + moved(kind, directions, 0.97 * size, measured)
        assert judged(golden, below, ref, x, directions, envelope=envelope).passed
        above = port + moved(kind, directions, 1.03 * size, measured)
        failed = judged(golden, above, ref, x, directions, envelope=envelope)
        assert not failed.passed
        failing |= {c.name for c in failed.checks if not c.ok}
    assert limit.check in failing


def test_the_line_names_what_is_seen_and_what_is_not():
    x, ref, golden, directions, port = layer()
    seen = judged(golden, port, ref, x, directions).sight
    text = seen.describe()
    assert text.startswith("sees attention output +-")
    assert "attention scores' scale +-" in text and "(beyond the port's own error)" in text
    x, ref, golden, directions, port = layer(attention_size=1e-4)
    blind = judged(golden, port, ref, x, directions).sight
    assert blind.by_kind()["attention_scale"].both_ways is None or not blind.by_kind()["attention_scale"].in_sight
    assert "out of sight: attention output within +-10% (bfloat16; float32 goldens" in blind.describe()


def test_a_failing_test_states_the_limits_of_a_port_as_exact_as_the_reference():
    x, ref, golden, directions, port = layer()
    failing = judged(golden, port + moved("mlp_scale", directions, 0.2), ref, x, directions)
    assert not failing.passed and failing.sight.base == "reference"
    assert "in a port that rounds as the reference did" in failing.sight.describe()
    reference = judged(golden, golden.double(), ref, x, directions).sight
    assert failing.sight.by_kind()["mlp_scale"].high == pytest.approx(reference.by_kind()["mlp_scale"].high)


def test_goldens_without_the_steps_state_the_branches_alone():
    """A golden from before the steps were stored has no temperature limit."""
    x, ref, golden, directions, port = layer()
    kinds = judged(golden, port, ref, x, directions, steps=False).sight.by_kind()
    assert set(kinds) == {"attention_scale", "mlp_scale"}
    tensors = {STEP_PREFIX + "attention_temperature": torch.tensor(2.0), "floor.move.gelu_form": torch.tensor(1.0)}
    assert branch_moves(tensors, STEP_PREFIX) == {"attention_temperature": 2.0}


def test_a_post_norm_layer_states_no_branch_scale():
    """Where the branches' outputs do not add up to the layer's contribution (each normalised
    before it is added), a scale of them moves nothing: only the other kinds are stated."""
    x, ref, golden, directions, port = layer(post_norm=True)
    assert set(judged(golden, port, ref, x, directions).sight.by_kind()) == {"temperature"}
    measured = judged(golden, port, ref, x, directions, measured=True).sight.by_kind()
    assert set(measured) == {"attention_scale", "temperature", "norm_epsilon"}  # measured: no sum needed
