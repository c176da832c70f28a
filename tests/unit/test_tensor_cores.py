"""The float32 attention of tensor-core kernels that half the perturbed runs take
(reference/tensor_cores.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pytest_layerparity.reference.perturb import PerturbedArithmetic
from pytest_layerparity.reference.tensor_cores import LEAN_ULPS, float32_ulp, leaned, toward_zero


def _own_ulps(out: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Each result's error toward zero (positive: smaller in magnitude), in ulps of its own."""
    return (exact.abs() - out.double().abs()) / float32_ulp(exact)


def test_float32_ulp_is_the_distance_to_the_next_float32():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1)).abs() * 100
    following = torch.nextafter(x, torch.tensor(float("inf")))
    assert torch.equal(float32_ulp(x.double()), (following.double() - x.double()))


def test_toward_zero_never_rounds_away_and_stays_within_an_ulp():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    r = toward_zero(x)
    assert r.dtype == torch.float32
    assert (r.double().abs() <= x.abs()).all()
    assert ((x - r.double()).abs() < torch.finfo(torch.float32).eps * x.abs()).all()
    assert (r.double().abs() < x.abs()).float().mean() > 0.99  # a random float64 is rarely a float32


def test_leaned_results_move_toward_zero_by_the_lean_on_average():
    wide = torch.randn(100_000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    moved = _own_ulps(leaned(wide, torch.Generator().manual_seed(0)), wide)
    assert (moved >= 0).all() and moved.max() <= 2 * LEAN_ULPS
    assert abs(moved.mean().item() - LEAN_ULPS) < 0.05


def _qkv(batch: int, kv_heads: int = 2, tokens: int = 24, dim: int = 16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 2, tokens, dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, tokens, dim, generator=g) for _ in range(2))
    return q, k, v + 0.5


@pytest.mark.parametrize("gqa", [False, True])
def test_half_the_runs_take_a_float32_attention_leaning_toward_zero(gqa):
    runs = 8
    q, k, v = _qkv(runs, kv_heads=1 if gqa else 2)
    mask = torch.randn(runs, 1, 24, 24, generator=torch.Generator().manual_seed(4))  # rows of its own per run
    with PerturbedArithmetic(1000, samples=runs) as run:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    (picked,) = run._picks.values()
    assert 0 < int(picked.sum()) < runs
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double(), enable_gqa=gqa)
    for i in range(runs):
        moved = _own_ulps(out[i], exact[i])
        if picked[i]:  # every result smaller, by the lean (elements near zero err more in their own ulps)
            assert (moved >= 0).all() and abs(moved.median().item() - LEAN_ULPS) < 0.5
        else:  # the reference's error, its sign drawn anew
            assert abs(moved.median().item()) < 0.5 and (moved < 0).float().mean() > 0.3


def test_a_sixteen_bit_attention_takes_no_lean():
    q, k, v = (t.bfloat16() for t in _qkv(4))
    with PerturbedArithmetic(1000, samples=4) as run:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not run._picks  # tensor cores' float32 sums are far within a 16-bit result's rounding
