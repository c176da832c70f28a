"""The float32 attention of tensor-core kernels that half the perturbed runs take
(noise/tensor_cores.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pytest_layerparity.noise.algorithms import eager_attention
from pytest_layerparity.noise.perturb import PerturbedArithmetic
from pytest_layerparity.noise.tensor_cores import (
    FULL_LEAN_KEYS,
    LEAN_FROM_KEYS,
    LEAN_ULPS,
    float32_ulp,
    lean_ulps,
    leaned,
    seen_keys,
    toward_zero,
)


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
        if picked[i]:  # every result smaller, by 24 keys' lean (elements near zero err more in their own ulps)
            assert (moved >= 0).all() and abs(moved.median().item() - lean_ulps(torch.tensor(24)).item()) < 0.5
        else:  # the reference's error, its sign drawn anew
            assert abs(moved.median().item()) < 0.5 and (moved < 0).float().mean() > 0.3


def test_a_sixteen_bit_attention_takes_no_lean():
    q, k, v = (t.bfloat16() for t in _qkv(4))
    with PerturbedArithmetic(1000, samples=4) as run:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # tensor cores' float32 sums are far within a 16-bit result's rounding: the one pick is eager attention's
    assert [code for code, _ in run._picks] == [eager_attention.__code__]


def test_the_lean_grows_from_none_to_the_full_lean_with_the_keys_logarithm():
    keys = torch.tensor([1, LEAN_FROM_KEYS, 16, FULL_LEAN_KEYS, 33, 4096])
    assert lean_ulps(keys).tolist() == pytest.approx([0, 0, LEAN_ULPS / 2, LEAN_ULPS, LEAN_ULPS, LEAN_ULPS])
    wide = torch.randn(100_000, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    assert abs(_own_ulps(leaned(wide, torch.Generator().manual_seed(6), 2.0), wide).mean().item() - 2.0) < 0.05


SDPA_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def test_the_keys_a_query_sees_are_its_masks_and_causal_ones():
    q, k, _ = _qkv(2, tokens=6)
    assert seen_keys(SDPA_CPU, (q, k, k, 0.0, False), {}).tolist() == [6] * 6
    assert seen_keys(SDPA_CPU, (q, k, k, 0.0, True), {}).tolist() == [1, 2, 3, 4, 5, 6]
    few = torch.ones(6, 6, dtype=torch.bool).triu_(3)  # query i sees keys i + 3 on
    additive = torch.zeros(2, 1, 6, 6).masked_fill_(~few, torch.finfo(torch.float32).min)
    additive[1] = additive[1].masked_fill(~few, float("-inf"))
    assert seen_keys(SDPA_CPU, (q, k, k, 0.0, False), {"attn_mask": few}).tolist() == [3, 2, 1, 0, 0, 0]
    assert seen_keys(SDPA_CPU, (q, k, k, 0.0, False), {"attn_mask": additive}).tolist() == [[[3, 2, 1, 0, 0, 0]]] * 2
    window = torch.ones(6, 6, dtype=torch.bool).triu_(-1)  # query i sees keys i - 1 on
    assert seen_keys(SDPA_CPU, (q, k, k, 0.0, True), {"attn_mask": window}).tolist() == [1, 2, 2, 2, 2, 2]


def test_a_causal_attention_leans_its_rows_by_the_keys_they_see():
    runs, tokens = 4, 64
    q, k, v = _qkv(runs, tokens=tokens)
    with PerturbedArithmetic(1000, samples=runs) as run:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (picked,) = run._picks.values()
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    i = int(picked.nonzero()[0])
    moved = _own_ulps(out[i], exact[i])  # heads x queries x head_dim
    few, many = moved[:, :LEAN_FROM_KEYS], moved[:, FULL_LEAN_KEYS:]
    assert abs(few.median().item()) < 0.5 and (few < 0).float().mean() > 0.3  # the perturbed value, no lean
    assert (many >= 0).all() and abs(many.median().item() - LEAN_ULPS) < 0.5
    middle = moved[:, 15]  # query 15 sees 16 keys: half the lean
    assert (middle >= 0).all() and abs(middle.median().item() - LEAN_ULPS / 2) < 0.75
