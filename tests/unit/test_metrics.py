"""Table tests of pytest_layerparity.compare.metrics against an independent float64 numpy reference."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from pytest_layerparity.compare.chunk_sums import REL_TINY
from pytest_layerparity.compare.metrics import (
    METRIC_NAMES,
    Metrics,
    compare_tensors,
    min_passing_tolerance,
    noise_ratio,
)

pytestmark = pytest.mark.filterwarnings("error")

REL = 1e-9  # every statistic within 1e-9 relative of the float64 reference


# --------------------------------------------------------------------------- reference


def _np64(x: torch.Tensor) -> np.ndarray:
    """Exact float64 numpy copy of any real tensor (bf16 has no numpy dtype)."""
    x = x.detach().cpu()
    if x.dtype == torch.bfloat16:
        x = x.float()
    return x.numpy().astype(np.float64).reshape(-1)


def reference(golden, target, atol=1e-2, rtol=1e-2) -> dict:
    """The straightforward float64 computation that metrics.py must agree with."""
    g, t = _np64(golden), _np64(target)
    fin = np.isfinite(g) & np.isfinite(t)
    out = {
        "numel": g.size,
        "golden_nan": int(np.isnan(g).sum()),
        "golden_inf": int(np.isinf(g).sum()),
        "target_nan": int(np.isnan(t).sum()),
        "target_inf": int(np.isinf(t).sum()),
    }
    mism = np.flatnonzero(np.isfinite(g) != np.isfinite(t))
    gf, tf = g[fin], t[fin]
    n = gf.size
    if n == 0:
        nan = float("nan")
        out.update(dict.fromkeys((*METRIC_NAMES, "max_rel_diff"), nan))
        out["worst_flat"] = int(mism[0]) if mism.size else 0
        return out
    d = np.abs(tf - gf)
    out["max_abs_diff"] = float(d.max())
    out["mean_abs_diff"] = math.fsum(d) / n
    out["similarity_percentage"] = 100.0 * int((d <= atol + rtol * np.abs(gf)).sum()) / n
    out["max_rel_diff"] = float((d / (np.abs(gf) + REL_TINY)).max())
    ng, nt = math.sqrt(math.fsum(gf * gf)), math.sqrt(math.fsum(tf * tf))
    if ng == 0 and nt == 0:
        out["cosine_similarity"] = 1.0
    elif ng == 0 or nt == 0:
        out["cosine_similarity"] = 0.0
    else:
        out["cosine_similarity"] = math.fsum(gf * tf) / (ng * nt)
    g_const, t_const = gf.min() == gf.max(), tf.min() == tf.max()
    if g_const and t_const:
        out["pearson_correlation"] = 1.0 if out["max_abs_diff"] == 0 else 0.0
    elif g_const or t_const:
        out["pearson_correlation"] = 0.0
    else:
        gc, tc = gf - math.fsum(gf) / n, tf - math.fsum(tf) / n
        out["pearson_correlation"] = math.fsum(gc * tc) / math.sqrt(math.fsum(gc * gc) * math.fsum(tc * tc))
    if mism.size:
        out["worst_flat"] = int(mism[0])
    else:
        out["worst_flat"] = int(np.flatnonzero(fin)[np.argmax(d)])
    return out


def assert_matches(m: Metrics, ref: dict, shape) -> None:
    for name in (*METRIC_NAMES, "max_rel_diff"):
        got, want = getattr(m, name), ref[name]
        if math.isnan(want):
            assert math.isnan(got), name
        else:
            assert got == pytest.approx(want, rel=REL, abs=1e-300), name
    for name in ("numel", "golden_nan", "golden_inf", "target_nan", "target_inf"):
        assert getattr(m, name) == ref[name], name
    assert m.worst_index == tuple(int(i) for i in np.unravel_index(ref["worst_flat"], shape))
    assert -1.0 <= m.cosine_similarity <= 1.0 or math.isnan(m.cosine_similarity)
    assert -1.0 <= m.pearson_correlation <= 1.0 or math.isnan(m.pearson_correlation)


def _pair(dtype, shape, noise, seed, mean=0.0):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(shape, generator=gen, dtype=torch.float64) + mean
    t = g + noise * torch.randn(shape, generator=gen, dtype=torch.float64)
    return g.to(dtype), t.to(dtype)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("numel", [1, 1000, 1 << 20])
def test_identical_tensors(dtype, numel):
    g, _ = _pair(dtype, (numel,), 0.0, seed=numel)
    m = compare_tensors(g, g.clone())
    assert m.cosine_similarity <= 1.0
    assert m.cosine_similarity == pytest.approx(1.0, abs=1e-12)
    assert m.pearson_correlation <= 1.0
    assert m.pearson_correlation == pytest.approx(1.0, abs=1e-12)
    assert m.max_abs_diff == 0.0 and m.mean_abs_diff == 0.0 and m.max_rel_diff == 0.0
    assert m.similarity_percentage == 100.0
    assert m.worst_index == (0,)  # all diffs tie at 0: the first one


def test_identical_large_bf16_cosine_never_above_one():
    # 4M bf16 elements: float32 accumulation drifts measurably here; float64 must not.
    g = torch.randn(1 << 22, generator=torch.Generator().manual_seed(1)).bfloat16()
    m = compare_tensors(g, g)
    assert 1.0 - 1e-12 <= m.cosine_similarity <= 1.0
    assert 1.0 - 1e-12 <= m.pearson_correlation <= 1.0


@pytest.mark.parametrize(
    "dtype,noise,numel",
    [
        (torch.bfloat16, 1e-2, 100_000),
        (torch.bfloat16, 1.0, 100_000),
        (torch.bfloat16, 1e-2, 700_001),  # several default chunks, ragged end
        (torch.float16, 1e-2, 100_000),
        (torch.float16, 1e-3, 65_537),
        (torch.float32, 1e-2, 100_000),
        (torch.float32, 1e-6, 100_000),
        (torch.float64, 1e-9, 100_000),
        (torch.float32, 10.0, 50_000),  # nearly uncorrelated
    ],
)
def test_random_pairs_match_float64_reference(dtype, noise, numel):
    g, t = _pair(dtype, (numel,), noise, seed=numel + int(noise * 1000))
    m = compare_tensors(g, t)
    assert_matches(m, reference(g, t), g.shape)
    assert 0.0 < m.similarity_percentage <= 100.0
    assert m.worst_golden == float(g[m.worst_index]) and m.worst_target == float(t[m.worst_index])
    assert m.noise_ratio is None and not m.has_nan_or_inf


@pytest.mark.parametrize(
    "dtype,mean,noise",
    [
        (torch.float32, 1000.0, 1e-3),
        (torch.float64, 1000.0, 1e-6),
        (torch.float64, -1e6, 1e-3),
        (torch.bfloat16, 1000.0, 1e-1),
        (torch.float32, 1e4, 1e-2),
    ],
)
def test_large_offset_pearson_is_stable(dtype, mean, noise):
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(200_000, generator=gen, dtype=torch.float64)
    g = (mean + 0.01 * base).to(dtype)
    t = (mean + 0.01 * base + noise * torch.randn(200_000, generator=gen, dtype=torch.float64)).to(dtype)
    ref = reference(g, t)
    m = compare_tensors(g, t, chunk_elements=30_000)
    assert_matches(m, ref, g.shape)
    # the naive one-pass formula in float64 is measurably off on these inputs
    assert m.pearson_correlation == pytest.approx(ref["pearson_correlation"], rel=1e-9)


def _with_nonfinite(where, dtype):
    g, t = _pair(dtype, (4, 25), 0.05, seed=3)
    g, t = g.clone(), t.clone()
    if where == "golden":
        g[1, 3], g[2, 0], g[3, 9] = float("nan"), float("inf"), float("-inf")
    elif where == "target":
        t[0, 7], t[0, 8], t[3, 1] = float("inf"), float("nan"), float("nan")
    elif where == "both_same_position":
        g[0, 2] = t[0, 2] = float("nan")
        g[1, 1] = t[1, 1] = float("inf")
    elif where == "mixed":
        t[2, 4] = float("nan")
        g[0, 20] = float("inf")
        g[1, 5] = t[1, 5] = float("nan")
    return g, t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "where,counts,worst",
    [
        ("golden", (1, 2, 0, 0), (1, 3)),
        ("target", (0, 0, 2, 1), (0, 7)),
        ("both_same_position", (1, 1, 1, 1), None),  # no mismatch: worst is the max diff
        ("mixed", (1, 1, 2, 0), (0, 20)),
    ],
)
@pytest.mark.parametrize("chunk", [None, 7])
def test_nan_inf(dtype, where, counts, worst, chunk):
    g, t = _with_nonfinite(where, dtype)
    m = compare_tensors(g, t, chunk_elements=chunk)
    ref = reference(g, t)
    assert (m.golden_nan, m.golden_inf, m.target_nan, m.target_inf) == counts
    assert m.has_nan_or_inf
    assert_matches(m, ref, g.shape)  # statistics over the finite pairs only
    if worst is not None:
        assert m.worst_index == worst
        assert not (math.isfinite(m.worst_golden) and math.isfinite(m.worst_target))
    else:
        assert math.isfinite(m.worst_golden) and math.isfinite(m.worst_target)
        assert abs(m.worst_target - m.worst_golden) == m.max_abs_diff


def test_no_finite_pair_gives_nan_statistics():
    g = torch.tensor([[float("nan"), float("inf")], [float("nan"), 1.0]])
    t = torch.tensor([[float("nan"), float("inf")], [2.0, float("nan")]])
    m = compare_tensors(g, t)
    for name in (*METRIC_NAMES, "max_rel_diff"):
        assert math.isnan(getattr(m, name)), name
    assert m.worst_index == (1, 0)  # first position where only one side is finite
    m2 = compare_tensors(torch.full((2, 3), float("nan")), torch.full((2, 3), float("nan")))
    assert math.isnan(m2.cosine_similarity) and m2.worst_index == (0, 0)
    assert (m2.golden_nan, m2.target_nan) == (6, 6)


@pytest.mark.parametrize(
    "g,t,cos,pear",
    [
        (torch.zeros(10), torch.zeros(10), 1.0, 1.0),
        (torch.zeros(10), torch.arange(10.0), 0.0, 0.0),
        (torch.arange(10.0), torch.zeros(10), 0.0, 0.0),
        (torch.full((10,), 3.0), torch.full((10,), 3.0), 1.0, 1.0),
        (torch.full((10,), 3.0), torch.full((10,), 5.0), 1.0, 0.0),
        (torch.full((10,), 3.0), torch.full((10,), -2.0), -1.0, 0.0),
        (torch.full((10,), 0.1), torch.full((10,), 0.1), 1.0, 1.0),
        (torch.full((1000,), 1000.1, dtype=torch.float64), torch.full((1000,), 1000.1, dtype=torch.float64), 1.0, 1.0),
        (torch.full((10,), 3.0), torch.arange(10.0), None, 0.0),
        (torch.arange(10.0), -torch.arange(10.0), -1.0, -1.0),
        (torch.arange(10.0), 2 * torch.arange(10.0) + 7, None, 1.0),
    ],
)
def test_zero_and_constant_tensors(g, t, cos, pear):
    m = compare_tensors(g, t, chunk_elements=3)
    if cos is not None:
        assert m.cosine_similarity == pytest.approx(cos, abs=1e-15)
    assert m.pearson_correlation == pytest.approx(pear, abs=1e-15)
    assert -1.0 <= m.cosine_similarity <= 1.0 and -1.0 <= m.pearson_correlation <= 1.0


@pytest.mark.parametrize("fn", [compare_tensors, min_passing_tolerance, lambda g, t: noise_ratio(g, t, g)])
def test_shape_mismatch_names_both_shapes(fn):
    with pytest.raises(ValueError) as info:
        fn(torch.zeros(2, 3), torch.zeros(3, 2))
    assert "(2, 3)" in str(info.value) and "(3, 2)" in str(info.value)


def test_floor_shape_mismatch():
    with pytest.raises(ValueError, match=r"\(4,\).*\(5,\)"):
        compare_tensors(torch.zeros(4), torch.zeros(4), floor=torch.zeros(5))


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 2, 5)])
def test_empty_tensors(shape):
    m = compare_tensors(torch.empty(shape, dtype=torch.bfloat16), torch.empty(shape))
    assert m.numel == 0
    assert (m.max_abs_diff, m.mean_abs_diff, m.max_rel_diff) == (0.0, 0.0, 0.0)
    assert m.similarity_percentage == 100.0
    assert m.cosine_similarity == 1.0 and m.pearson_correlation == 1.0
    assert not m.has_nan_or_inf
    json.dumps(m.as_dict())
    assert min_passing_tolerance(torch.empty(shape), torch.empty(shape)) == {"atol": 0.0, "rtol": 0.0}


def test_scalar_tensors():
    m = compare_tensors(torch.tensor(2.0), torch.tensor(2.5))
    assert m.worst_index == () and m.max_abs_diff == 0.5 and m.numel == 1
    assert m.cosine_similarity == 1.0 and m.pearson_correlation == 0.0


@pytest.mark.parametrize(
    "gdtype,tdtype",
    [
        (torch.int64, torch.int64),
        (torch.int32, torch.int16),
        (torch.uint8, torch.uint8),
        (torch.int64, torch.float32),
    ],
)
def test_integer_tensors_are_exact(gdtype, tdtype):
    g = torch.tensor([[1, 2, 3], [40, 50, 60]]).to(gdtype)
    t = torch.tensor([[1, 2, 7], [40, 51, 60]]).to(tdtype)
    m = compare_tensors(g, t)
    assert m.max_abs_diff == 4.0
    assert m.mean_abs_diff == pytest.approx(5.0 / 6.0, rel=1e-15)
    assert m.worst_index == (0, 2) and (m.worst_golden, m.worst_target) == (3.0, 7.0)
    assert m.max_rel_diff == pytest.approx(4.0 / 3.0, rel=1e-15)
    assert_matches(m, reference(g, t), g.shape)


def test_int64_beyond_float32_precision():
    g = torch.tensor([2**40, 2**40 + 1, 5], dtype=torch.int64)
    t = torch.tensor([2**40 + 1, 2**40 + 1, 5], dtype=torch.int64)
    m = compare_tensors(g, t)
    assert m.max_abs_diff == 1.0 and m.worst_index == (0,)  # float32 would see 0 here


def test_bool_tensors():
    g = torch.tensor([True, False, True, True])
    t = torch.tensor([True, True, True, False])
    m = compare_tensors(g, t, sim_atol=0.0, sim_rtol=0.0)
    assert m.max_abs_diff == 1.0 and m.similarity_percentage == 50.0 and m.worst_index == (1,)


@pytest.mark.parametrize(
    "gdtype,tdtype",
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.bfloat16),
        (torch.float64, torch.float16),
        (torch.bfloat16, torch.float64),
    ],
)
def test_mixed_dtypes(gdtype, tdtype):
    g64, t64 = _pair(torch.float64, (300, 70), 1e-2, seed=11)
    g, t = g64.to(gdtype), t64.to(tdtype)
    m = compare_tensors(g, t, chunk_elements=4096)
    assert_matches(m, reference(g, t), g.shape)


@pytest.mark.parametrize("chunk", [1, 7, 10, 99, 100, 101, 4096])
def test_chunk_boundaries_do_not_change_results(chunk):
    g, t = _pair(torch.bfloat16, (10, 10), 0.1, seed=5)
    ref = reference(g, t)
    m = compare_tensors(g, t, chunk_elements=chunk)
    assert_matches(m, ref, g.shape)
    whole = compare_tensors(g, t, chunk_elements=10**6)
    for name in (*METRIC_NAMES, "max_rel_diff"):
        assert getattr(m, name) == pytest.approx(getattr(whole, name), rel=1e-12, abs=0)


@pytest.mark.parametrize("chunk", [7, 8, 13, None])
def test_worst_ties_resolve_to_first_position(chunk):
    g = torch.zeros(50)
    t = torch.zeros(50)
    t[6], t[13], t[41] = 2.0, -2.0, 2.0  # equal |diff| in different chunks
    m = compare_tensors(g, t, chunk_elements=chunk)
    assert m.worst_index == (6,) and m.max_abs_diff == 2.0


def test_worst_index_is_multi_dimensional():
    g, t = _pair(torch.float32, (3, 4, 5), 1e-3, seed=9)
    t = t.clone()
    t[2, 1, 3] += 10.0
    m = compare_tensors(g, t, chunk_elements=7)
    assert m.worst_index == (2, 1, 3)
    assert m.worst_golden == float(g[2, 1, 3]) and m.worst_target == float(t[2, 1, 3])
    assert m.max_abs_diff == pytest.approx(abs(float(t[2, 1, 3]) - float(g[2, 1, 3])), rel=1e-15)


@pytest.mark.parametrize(
    "atol,rtol,expected",
    [
        (0.5, 0.0, 60.0),  # |d| <= 0.5 (inclusive): d = 0, 0.25, 0.5 pass
        (0.0, 0.0, 20.0),  # only the exact match
        (0.0, 0.5, 80.0),  # |d| <= |g|/2: 0, 0.25, 0.5 (g=1) and 1.0 (g=2, tie) pass
        (0.25, 0.25, 60.0),  # tolerances 0.5, 0.5, 0.5, 0.75, 0.75
        (10.0, 0.0, 100.0),
    ],
)
def test_similarity_tolerance_is_inclusive(atol, rtol, expected):
    g = torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0])
    t = torch.tensor([1.0, 1.25, 1.5, 3.0, 4.0])
    m = compare_tensors(g, t, sim_atol=atol, sim_rtol=rtol)
    assert m.similarity_percentage == pytest.approx(expected, rel=1e-15)


def test_tiny_fp32_values_use_float64_products():
    # float32 products of 1e-25 underflow to 0; the float64 reference does not.
    g, t = _pair(torch.float32, (10_000,), 1e-1, seed=2)
    g, t = g * 1e-25, t * 1e-25
    m = compare_tensors(g, t)
    assert_matches(m, reference(g, t), g.shape)
    assert m.cosine_similarity < 0.999


def test_non_contiguous_and_requires_grad():
    g, t = _pair(torch.float32, (64, 48), 1e-2, seed=4)
    gt_, tt_ = g.t(), t.t()
    assert not gt_.is_contiguous()
    m = compare_tensors(gt_.requires_grad_(True), tt_, chunk_elements=100)
    assert_matches(m, reference(gt_, tt_), gt_.shape)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="chunk_elements"):
        compare_tensors(torch.zeros(3), torch.zeros(3), chunk_elements=0)
    with pytest.raises(ValueError, match="sim_atol"):
        compare_tensors(torch.zeros(3), torch.zeros(3), sim_atol=-1.0)
    with pytest.raises(TypeError, match="complex"):
        compare_tensors(torch.zeros(3, dtype=torch.complex64), torch.zeros(3, dtype=torch.complex64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_noise_ratio(dtype):
    gen = torch.Generator().manual_seed(21)
    ref = torch.randn(1000, generator=gen, dtype=torch.float64)
    g = (ref + 1e-2 * torch.randn(1000, generator=gen, dtype=torch.float64)).to(dtype)
    t = (ref + 3e-2 * torch.randn(1000, generator=gen, dtype=torch.float64)).to(dtype)
    r32 = ref.float()
    want = np.linalg.norm(_np64(t) - _np64(r32)) / (np.linalg.norm(_np64(g) - _np64(r32)) + 1e-12)
    got = noise_ratio(g, t, r32)
    assert got == pytest.approx(want, rel=1e-12)
    assert 2.0 < got < 4.5  # the target is ~3x noisier than the golden
    m = compare_tensors(g, t, floor=r32, chunk_elements=77)
    assert m.noise_ratio == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(
    "g,t,r,want",
    [
        ([1.0, 2.0], [1.0, 2.0], [1.0, 2.0], 0.0),  # both norms zero
        ([1.0, 2.0], [1.0, 5.0], [1.0, 2.0], 3.0 / 1e-12),  # golden equals reference
        ([3.0, 0.0], [0.0, 4.0], [0.0, 0.0], 4.0 / 3.0),
        ([1.0, float("nan")], [1.0, 2.0], [1.0, 2.0], float("nan")),
    ],
)
def test_noise_ratio_table(g, t, r, want):
    got = noise_ratio(torch.tensor(g), torch.tensor(t), torch.tensor(r))
    if math.isnan(want):
        assert math.isnan(got)
    else:
        assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(
    "g,t,atol,rtol",
    [
        ([1.0, 2.0, 4.0], [1.0, 2.0, 4.0], 0.0, 0.0),
        ([1.0, 2.0, 4.0], [1.5, 2.0, 3.0], 1.0, 0.5),
        ([-2.0, 0.0, 8.0], [-2.5, 0.0, 8.0], 0.5, 0.25),  # g == 0 == t is fine
        ([1.0, 0.0], [1.0, 1e-3], 1e-3, float("inf")),  # g == 0 != t: no rtol passes
        ([float("inf"), 1.0], [float("inf"), 1.5], 0.5, 0.5),  # equal infinities pass
        ([float("inf"), 1.0], [1.0, 1.0], float("inf"), float("inf")),
        ([float("nan"), 1.0], [float("nan"), 1.0], float("inf"), float("inf")),
    ],
)
def test_min_passing_tolerance(g, t, atol, rtol):
    gt_, tt_ = torch.tensor(g, dtype=torch.float64), torch.tensor(t, dtype=torch.float64)
    got = min_passing_tolerance(gt_, tt_)
    assert got == {"atol": atol, "rtol": rtol}
    if math.isfinite(atol):
        assert torch.allclose(tt_, gt_, atol=atol, rtol=0.0)
        if atol > 0:
            assert not torch.allclose(tt_, gt_, atol=atol * (1 - 1e-9), rtol=0.0)
    if math.isfinite(rtol):
        assert torch.allclose(tt_, gt_, atol=0.0, rtol=rtol * (1 + 1e-12))
        if rtol > 0:
            assert not torch.allclose(tt_, gt_, atol=0.0, rtol=rtol * (1 - 1e-9))


def test_min_passing_tolerance_random_bf16_matches_reference():
    g, t = _pair(torch.bfloat16, (1000,), 1e-2, seed=8)
    gg, tt = _np64(g), _np64(t)
    got = min_passing_tolerance(g, t)
    nz = gg != 0
    assert got["atol"] == np.abs(tt - gg).max()
    assert got["rtol"] == (np.abs(tt - gg)[nz] / np.abs(gg[nz])).max()


def test_as_dict_json_round_trip():
    g, t = _pair(torch.bfloat16, (4, 6), 1e-1, seed=12)
    m = compare_tensors(g, t, floor=g.float())
    d = m.as_dict()
    assert isinstance(d["worst_index"], list)
    back = json.loads(json.dumps(d))
    assert back == d
    assert Metrics(**{**back, "worst_index": tuple(back["worst_index"])}) == m
    assert set(METRIC_NAMES) <= set(d)
    assert all(isinstance(d[k], float) for k in METRIC_NAMES)
    assert all(type(d[k]) is int for k in ("numel", "golden_nan", "golden_inf", "target_nan", "target_inf"))


def test_as_dict_with_nan_is_still_dumpable():
    m = compare_tensors(torch.tensor([float("nan")]), torch.tensor([1.0]))
    text = json.dumps(m.as_dict())
    assert "NaN" in text and m.as_dict()["noise_ratio"] is None


def test_metrics_is_frozen():
    m = compare_tensors(torch.ones(3), torch.ones(3))
    with pytest.raises(AttributeError):
        m.max_abs_diff = 1.0  # type: ignore[misc]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("target_device", ["cuda", "cpu"])
def test_cuda_matches_cpu(target_device):
    g, t = _pair(torch.bfloat16, (1 << 20,), 1e-2, seed=13)
    ref = reference(g, t)
    m = compare_tensors(g.cuda(), t.to(target_device), floor=g.float().cuda())
    assert_matches(m, ref, g.shape)


def test_xla_tensors_are_compared_on_the_cpu():
    pytest.importorskip("torch_xla")
    import torch_xla

    dev = torch_xla.device()
    g, t = _pair(torch.bfloat16, (40, 25), 1e-2, seed=14)
    ref = reference(g, t)
    assert_matches(compare_tensors(g, t.to(dev), chunk_elements=7), ref, g.shape)
    m = compare_tensors(g.to(dev), t.to(dev), floor=g.float().to(dev))
    assert_matches(m, ref, g.shape)
    assert m.noise_ratio == pytest.approx(noise_ratio(g, t, g.float()), rel=1e-12)


def test_a_pass_shared_over_threads_gives_what_one_thread_gives():
    """The CPU pass shared out over threads (contiguous runs of chunks, one Python thread
    each) sums each chunk as one thread does: the same figures, NaN/Inf and worst element too."""
    gen = torch.Generator().manual_seed(7)
    g = torch.randn(50_000, generator=gen).bfloat16()
    t = (g.float() + 0.01 * torch.randn(50_000, generator=gen)).bfloat16()
    t[12_345], g[40_000] = float("nan"), float("inf")
    r = g.float() + 0.001
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = compare_tensors(g, t, floor=r, chunk_elements=1000)
        torch.set_num_threads(4)
        shared = compare_tensors(g, t, floor=r, chunk_elements=1000)
        assert torch.get_num_threads() == 4  # given back as it was
    finally:
        torch.set_num_threads(before)
    assert repr(shared.as_dict()) == repr(alone.as_dict())  # NaN figures included (NaN != NaN)
    assert shared.target_nan == 1 and shared.golden_inf == 1
