"""Monte Carlo arithmetic (noise.perturb): each mode perturbs what rounds, within the
bounds it promises, leaves exact ops alone and applies an in-place op once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pytest_layerparity.noise import draws, rounding
from pytest_layerparity.noise.algorithms import in_order_scores_attention, one_pass_var_mean
from pytest_layerparity.noise.lowerings import IN_ORDER_FROM
from pytest_layerparity.noise.perturb import BLOCKED_SUM_SCALE, PerturbedArithmetic
from pytest_layerparity.noise.rounding import another_rounding, stochastic_round
from pytest_layerparity.noise.sums import fused_sequential_sum, sequential_sum_error_std
from pytest_layerparity.noise.wider import attention_reference, exact_fast_matmul, query_block


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in ulps of b's dtype at b."""
    spacing = (torch.nextafter(b, torch.full_like(b, float("inf"))) - b).abs().double()
    return (a.double() - b.double()).abs() / spacing


@pytest.mark.parametrize(("wide", "narrow"), [(torch.float32, torch.bfloat16), (torch.float64, torch.float32)])
def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased(wide, narrow):
    x = torch.full((20000,), 1.0, dtype=wide) + 0.3 * float(torch.finfo(narrow).eps)
    out = stochastic_round(x, narrow, torch.Generator().manual_seed(0))
    low = x.to(narrow)  # nearest is the lower neighbour here
    high = torch.nextafter(low, torch.full_like(low, 2.0))
    assert bool(((out == low) | (out == high)).all())
    assert (out == high).double().mean().item() == pytest.approx(0.3, abs=0.02)
    spread = 5 * float(torch.finfo(narrow).eps) * (0.25 / x.numel()) ** 0.5  # five standard errors
    assert out.double().mean().item() == pytest.approx(x.double().mean().item(), abs=spread)


def test_another_rounding_of_an_elementwise_result_is_stochastic_rounding():
    wide = torch.full((20000,), 1.0) + 0.3 * 2**-7
    result = wide.to(torch.bfloat16)
    out = another_rounding(result, wide, torch.Generator().manual_seed(1))
    assert (out != result).double().mean().item() == pytest.approx(0.3, abs=0.02)


def test_a_pulled_rounding_takes_the_other_neighbour_half_as_often():
    """With ``pull`` 0.5 an elementwise result 0.3 ulp from its exact value goes to the other
    neighbour with half stochastic rounding's probability (0.15), never elsewhere."""
    wide = torch.full((20000,), 1.0) + 0.3 * 2**-7
    result = wide.to(torch.bfloat16)
    out = another_rounding(result, wide, torch.Generator().manual_seed(1), pull=0.5)
    assert bool(_on_neighbours(out, wide.double()).all())
    assert (out != result).double().mean().item() == pytest.approx(0.15, abs=0.015)


def test_a_bfloat16_matmul_errs_between_a_correct_and_a_stochastic_rounding():
    """A bfloat16 matmul under the jitter mode errs 1.5 times a correct rounding's squared
    error (the point halfway to the reference's result, rounded stochastically), another way
    in each run; stochastic rounding (the ``stochastic`` mode) errs twice it."""
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(128, 256, generator=g).bfloat16(), torch.randn(256, 128, generator=g).bfloat16()
    wide = a.double() @ b.double()
    correct = (wide.bfloat16().double() - wide).square().mean().item()
    runs = {}
    for seed, mode in ((3, "jitter"), (4, "jitter"), (3, "stochastic")):
        with PerturbedArithmetic(seed, mode):
            runs[seed, mode] = a @ b
    one = runs[3, "jitter"]
    assert (one.double() - wide).square().mean().item() / correct == pytest.approx(1.5, abs=0.1)
    assert (runs[3, "stochastic"].double() - wide).square().mean().item() / correct == pytest.approx(2.0, abs=0.12)
    assert bool(_on_neighbours(one, wide).all()) and not torch.equal(one, runs[4, "jitter"])


def test_another_rounding_keeps_the_size_of_an_accumulation_error():
    wide = torch.linspace(1, 2, 4096, dtype=torch.float64)
    result = (wide + 5 * 2**-24 * wide).to(torch.float32)  # 5 ulp off, as a long reduction may be
    out = another_rounding(result, wide, torch.Generator().manual_seed(2))
    err = (out.double() - wide).abs() / (wide * 2**-24)
    assert err.mean().item() == pytest.approx(5.0, abs=0.6)
    assert ((out.double() - wide) < 0).double().mean().item() == pytest.approx(0.5, abs=0.05)  # sign drawn anew


@pytest.mark.parametrize("mode", ["jitter", "stochastic", "random"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_mode_stays_within_its_bound_and_varies_with_the_seed(mode, dtype):
    a = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    b = torch.randn(64, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    plain = a * b
    with PerturbedArithmetic(10, mode) as p:
        one = a * b
    with PerturbedArithmetic(11, mode):
        two = a * b
    assert p.ops == 1 and not torch.equal(one, two) and not torch.equal(one, plain)
    exact = a.double() * b.double()
    u = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}[dtype]
    relative = ((one.double() - exact).abs() / exact.abs()).max().item() / u
    # a product (no approximated function) keeps its error (at most u) and is rounded
    # stochastically (2u, one ulp) in the jitter mode too, in every dtype; the random mode
    # perturbs by u (and rounds: u)
    assert relative <= 3.0


def _on_neighbours(out: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Where ``out`` is one of the two values of its dtype around ``exact`` (float64): the
    nearest, or the next one on the exact value's side where it is not representable."""
    nearest = exact.to(out.dtype)
    toward = torch.where(nearest.double() > exact, -torch.inf, torch.inf).to(out.dtype)
    return (out == nearest) | ((out == torch.nextafter(nearest, toward)) & (nearest.double() != exact))


def test_a_float32_exp_is_moved_and_scaled_where_a_product_is_rounded_once():
    """In the jitter mode a float32 exp (an approximated function) is moved within half an
    ulp and its error doubled (the default error scale): it reaches beyond the 3u that rounding a
    product's kept or reflected error stochastically reaches; a float32 product lands on
    one of its exact value's two neighbours, as a kernel summing in another order would."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
    u = 2.0**-24
    with PerturbedArithmetic(10, "jitter"):
        exp, product = torch.exp(a), a * b
    wide_exp, wide_product = torch.exp(a.double()), a.double() * b.double()
    reach = ((exp.double() - wide_exp).abs() / wide_exp).max().item() / u
    with PerturbedArithmetic(10, "jitter", error_scale=1.0):
        unscaled = torch.exp(a)
    assert reach > 3.0 and reach > ((unscaled.double() - wide_exp).abs() / wide_exp).max().item() / u
    assert ((product.double() - wide_product).abs() / wide_product.abs()).max().item() / u <= 3.0
    assert bool(_on_neighbours(product, wide_product).all()) and not torch.equal(product, wide_product.float())


def test_error_scale_multiplies_an_ops_error():
    wide = torch.linspace(1, 2, 4096, dtype=torch.float64)
    result = (wide + 5 * 2**-24 * wide).to(torch.float32)
    sizes = []
    for scale in (1.0, 2.0):
        out = another_rounding(result, wide, torch.Generator().manual_seed(2), scale=scale)
        sizes.append(((out.double() - wide).abs() / (wide * 2**-24)).mean().item())
    assert sizes[0] == pytest.approx(5.0, abs=0.6) and sizes[1] == pytest.approx(10.0, abs=1.2)


def _sequential_float16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b summed one product at a time in float16 (each product and partial sum rounded)."""
    total = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float16)
    for i in range(a.shape[1]):
        total = (total.float() + (a[:, i : i + 1].float() * b[i : i + 1].float()).half().float()).half()
    return total


@pytest.mark.parametrize(("k", "offset"), [(256, 0.0), (1024, 0.0), (1024, 0.5)])
def test_sequential_sum_error_std_is_the_size_of_a_float16_sums_error(k, offset):
    """The predicted error of a float16 sequential sum (zero-mean products, and products with a
    drift) is within 25% of the error measured on such a sum, and far above one rounding."""
    g = torch.Generator().manual_seed(k)
    a = (torch.randn(32, k, generator=g) + offset).half()
    b = (torch.randn(k, 16, generator=g) / 16).half()
    exact = a.double() @ b.double()
    measured = (_sequential_float16(a, b).double() - exact).pow(2).mean().sqrt()
    predicted = sequential_sum_error_std(a, b, torch.float16).double().pow(2).mean().sqrt()
    assert predicted == pytest.approx(measured.item(), rel=0.25)
    assert predicted > 4 * (exact.half().double() - exact).pow(2).mean().sqrt()


def test_float16_matmuls_are_perturbed_as_float16_accumulation_and_bfloat16_ones_are_not():
    """Under the perturbation a float16 matmul is off by about a float16 sum's error; a
    bfloat16 one by about its final rounding alone (no kernel sums in bfloat16)."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(64, 1024, generator=g), torch.randn(1024, 32, generator=g) / 32
    relative = {}
    for dtype in (torch.float16, torch.bfloat16):
        a, b = x.to(dtype), w.to(dtype)
        exact = a.double() @ b.double()
        with PerturbedArithmetic(5):
            out = a @ b
        error = (out.double() - exact).pow(2).mean().sqrt()
        rounding = (exact.to(dtype).double() - exact).pow(2).mean().sqrt()
        relative[dtype] = (error / rounding).item()
    assert relative[torch.float16] > 4
    assert relative[torch.bfloat16] < 2


def _in_order_from_bias(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w + bias`` (batched or not) in float32, one product at a time, starting from the
    bias (as XLA's CPU backend computes a one-row dot fused with its bias), else from zero."""
    total = torch.zeros(*x.shape[:-1], w.shape[-1]) if bias is None else bias.expand(*x.shape[:-1], -1).clone()
    for i in range(x.shape[-1]):
        total = total + x[..., i : i + 1] * w[..., i : i + 1, :]
    return total


def test_float32_matmuls_sum_in_order_from_the_bias_in_half_the_runs():
    """Eight stacked runs of a float32 linear with a bias: those that take the in-order sum err
    as such a sum does (within 20%, ~3x eager's error at k 896), the others as eager does; both
    kinds occur. A bias-free one-row matmul this short errs as eager does in every run (XLA's CPU
    backend sums it in blocks below ``IN_ORDER_FROM``)."""
    g = torch.Generator().manual_seed(11)
    x, bias = torch.randn(1, 896, generator=g), torch.randn(256, generator=g)
    w = (torch.randn(256, 896, generator=g) / 30).t()  # a linear's weight, as F.linear passes it
    exact = x.double() @ w.double() + bias.double()

    def rms(t: torch.Tensor) -> float:
        return (t.double() - exact).pow(2).mean().sqrt().item()

    in_order, eager = rms(_in_order_from_bias(x, w, bias)), rms(torch.addmm(bias, x, w))
    assert in_order > 2 * eager
    with PerturbedArithmetic(4, samples=8):
        runs = torch.addmm(bias, x.repeat(8, 1), w)
        plain = x.repeat(8, 1) @ w
    sizes = [rms(runs[k : k + 1]) for k in range(8)]
    took = [s > (in_order + eager) / 2 for s in sizes]
    assert 0 < sum(took) < 8
    for size, yes in zip(sizes, took, strict=True):
        assert size == pytest.approx(in_order if yes else eager, rel=0.2)
    without = x.double() @ w.double()
    plain_eager = (x @ w).double() - without
    plain_sizes = [(plain[k].double() - without[0]).pow(2).mean().sqrt().item() for k in range(8)]
    assert max(plain_sizes) < 1.3 * plain_eager.pow(2).mean().sqrt().item()


def test_the_in_order_runs_compute_the_sum_one_fused_multiply_add_at_a_time():
    """The runs that sum a float32 one-row linear in order compute that sum (from the bias,
    each product fused into the partial sum with one rounding) bit for bit, not a draw of its
    error's size, on a bias with a few large channels (as a trained Qwen2.5's keys); the other
    runs do not. A product fused where a multiply then an add would round twice:
    (1 + 2^-13)(1 - 2^-13) - 1 is -2^-26 fused, 0 unfused."""
    g = torch.Generator().manual_seed(14)
    x, bias = torch.randn(1, 896, generator=g), torch.randn(128, generator=g)
    bias[:6] = 145.0
    w = (torch.randn(128, 896, generator=g) / 30).t()
    computed = fused_sequential_sum(x, w, bias)
    with PerturbedArithmetic(4, samples=8):
        runs = torch.addmm(bias, x.repeat(8, 1), w)
    same = [torch.equal(runs[j : j + 1], computed) for j in range(8)]
    assert 0 < sum(same) < 8
    one = torch.tensor([[1 + 2**-13]])
    assert fused_sequential_sum(one, torch.tensor([[1 - 2**-13]]), torch.tensor([-1.0])).item() == -(2**-26)
    assert (one * (1 - 2**-13) - 1).item() == 0.0


def test_long_bias_free_one_row_matmuls_sum_in_order_in_the_same_runs():
    """From ``IN_ORDER_FROM`` products on, a bias-free one-row float32 matmul sums in order in
    the runs that take the other lowering, the same runs as a linear with a bias: its error there
    is an in-order sum's, elsewhere eager's."""
    g = torch.Generator().manual_seed(13)
    k = IN_ORDER_FROM
    x, bias = torch.randn(1, k, generator=g), torch.randn(64, generator=g)
    w = (torch.randn(64, k, generator=g) / 64).t()
    exact = x.double() @ w.double()
    in_order = (_in_order_from_bias(x, w).double() - exact).pow(2).mean().sqrt().item()
    eager = ((x.repeat(8, 1) @ w)[:1].double() - exact).pow(2).mean().sqrt().item()  # the runs' kernel
    assert in_order > 1.5 * eager
    with PerturbedArithmetic(4, samples=8):
        biased = torch.addmm(bias, x.repeat(8, 1), w)
        plain = x.repeat(8, 1) @ w
    sizes = [(plain[j].double() - exact[0]).pow(2).mean().sqrt().item() for j in range(8)]
    took = [s > (in_order + eager) / 2 for s in sizes]
    assert 0 < sum(took) < 8
    for size, yes in zip(sizes, took, strict=True):
        assert size == pytest.approx(in_order if yes else eager, rel=0.25)
    with_bias = x.double() @ w.double() + bias.double()
    biased_sizes = [(biased[j].double() - with_bias[0]).pow(2).mean().sqrt().item() for j in range(8)]
    cut = (max(biased_sizes) + min(biased_sizes)) / 2
    assert [s > cut for s in biased_sizes] == took  # the same runs sum in order everywhere


def test_float32_matmuls_of_several_rows_are_not_summed_in_order():
    """A prompt's float32 linear (four rows a run) errs as eager does, or in the other
    lowering's runs BLOCKED_SUM_SCALE times that, never as an in-order sum: blocked kernels
    compute products of several rows."""
    g = torch.Generator().manual_seed(12)
    x, bias = torch.randn(4, 896, generator=g), torch.randn(256, generator=g)
    w = (torch.randn(256, 896, generator=g) / 30).t()
    exact = x.double() @ w.double() + bias.double()
    # the runs' kernel, eight runs' rows at once (on some CPUs it errs 1.9 times the four rows' alone)
    eager = (torch.addmm(bias, x.repeat(8, 1), w)[:4].double() - exact).pow(2).mean().sqrt().item()
    with PerturbedArithmetic(4, samples=8):
        runs = torch.addmm(bias, x.repeat(8, 1), w)
    sizes = [(runs[4 * k : 4 * k + 4].double() - exact).pow(2).mean().sqrt().item() for k in range(8)]
    wider = [s > 1.25 * eager for s in sizes]
    assert 0 < sum(wider) < 8
    for size, yes in zip(sizes, wider, strict=True):
        assert size == pytest.approx(BLOCKED_SUM_SCALE * eager if yes else eager, rel=0.15)


def test_norms_and_softmax_are_perturbed_reduction_by_reduction():
    """A fused layer norm or softmax runs as its decomposition: its mean, variance and sum are
    perturbed on their own (an error shared by the whole row), not only its output."""
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(6)) + 3
    with PerturbedArithmetic(1) as p:
        norm = torch.nn.functional.layer_norm(x, (64,))
    assert p.ops >= 4  # variance/mean, add eps, rsqrt, sub, mul (not one fused op)
    assert torch.allclose(norm, torch.nn.functional.layer_norm(x, (64,)), atol=1e-5)
    with PerturbedArithmetic(1) as p:
        soft = torch.softmax(x, dim=-1)
    assert p.ops >= 3 and torch.allclose(soft, torch.softmax(x, dim=-1), rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "kwargs", [{"dim": -1, "correction": 0, "keepdim": True}, {"dim": [0, 2]}, {}, {"dim": 1, "correction": 1}]
)
def test_one_pass_variance_is_the_variance(kwargs):
    x = torch.randn(3, 5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(7)) + 2
    var, mean = one_pass_var_mean(x, **kwargs)
    want_var, want_mean = torch.var_mean(x, **kwargs)
    assert var.shape == want_var.shape and torch.allclose(var, want_var) and torch.allclose(mean, want_mean)


def test_variance_runs_one_pass_in_some_runs_and_two_pass_in_others():
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(8)) + 50  # a large mean: one-pass cancels
    ops = set()
    for seed in range(8):
        with PerturbedArithmetic(seed) as p:
            torch.var_mean(x, dim=-1, unbiased=False)
        ops.add(p.ops)
    assert len(ops) == 2 and min(ops) == 2  # two-pass: one op, two outputs perturbed; one-pass: its own ops


def test_exact_ops_are_left_alone_and_in_place_ops_apply_once():
    x = torch.randn(8, 8, dtype=torch.bfloat16)
    with PerturbedArithmetic(5) as p:
        moved = torch.cat([x.t(), x[:2]]).clone()
        y = x.clone()
        y.add_(1.0)
    assert p.ops == 1 and torch.equal(moved, torch.cat([x.t(), x[:2]]))
    assert ((y.double() - (x.double() + 1.0)).abs() < 0.1).all()  # added once, not twice


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="jitter"):
        PerturbedArithmetic(0, "sometimes")


def _attention_inputs(gqa: bool):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 9, 16, generator=g)
    k, v = (torch.randn(1, 2 if gqa else 4, 9, 16, generator=g) for _ in range(2))
    mask = torch.randn(1, 1, 9, 9, generator=g)
    return q, k, v, mask


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize(
    ("op", "call"),
    [
        # each fused kernel's own calling convention, read from its schema
        ("_scaled_dot_product_flash_attention_for_cpu", lambda q, k, v, m: ((q, k, v, 0.0, False), {"attn_mask": m})),
        ("_scaled_dot_product_efficient_attention", lambda q, k, v, m: ((q, k, v, m, True, 0.0, False), {})),
        ("_scaled_dot_product_cudnn_attention", lambda q, k, v, m: ((q, k, v, m, False), {"scale": 0.25})),
        ("_scaled_dot_product_flash_attention", lambda q, k, v, m: ((q, k, v, 0.0, True), {})),
    ],
)
def test_fused_attention_is_referenced_by_the_math_attention_one_precision_wider(op, call, gqa):
    # cuDNN's attention, called with float32 inputs for a bfloat16 layer, returned values
    # hundreds of ulps off on an H100 instead of refusing: fused kernels are never widened.
    q, k, v, mask = _attention_inputs(gqa)
    args, kwargs = call(q, k, v, mask)
    func = getattr(torch.ops.aten, op).default
    wide = attention_reference(func, args, kwargs)
    named = dict(zip([a.name for a in func._schema.arguments], args, strict=False), **kwargs)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double(),
        k.double(),
        v.double(),
        attn_mask=None if named.get("is_causal") else mask.double(),
        is_causal=bool(named.get("is_causal")),
        scale=named.get("scale"),
        enable_gqa=gqa,
    )
    assert wide.dtype == torch.float64 and wide.shape == (1, 4, 9, 16)
    torch.testing.assert_close(wide, expected, rtol=1e-12, atol=1e-12)


def test_the_cpu_flash_attention_is_its_own_wider_result(monkeypatch):
    """The CPU flash kernel computes its wider result itself on widened inputs (no math
    attention, no scores held): the perturbation rounds around that result."""
    from pytest_layerparity.noise import perturb

    def refused(*_):
        raise AssertionError("the math attention was used")

    monkeypatch.setattr(perturb, "attention_reference", refused)
    q, k, v, mask = (t.bfloat16() for t in _attention_inputs(gqa=False))
    func = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    wide = PerturbedArithmetic(seed=1)._wider_results(func, (q, k, v, 0.0, False), {"attn_mask": mask})
    want = func(q.float(), k.float(), v.float(), 0.0, False, attn_mask=mask.float())
    assert torch.equal(wide[0], want[0]) and wide[0].dtype == torch.float32
    plain = func(q, k, v, 0.0, False, attn_mask=mask)[0]
    with PerturbedArithmetic(seed=1) as mode:
        out = func(q, k, v, 0.0, False, attn_mask=mask)[0]
    assert mode.ops >= 1 and out.dtype == torch.bfloat16 and not torch.equal(out, plain)
    assert ((out.float() - plain.float()).abs() <= 4 * 2**-8 * plain.float().abs().amax()).all()


def test_perturbed_attention_stays_within_rounding_of_the_plain_one():
    q, k, v, mask = (t.bfloat16() for t in _attention_inputs(gqa=True))
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    with PerturbedArithmetic(seed=1) as mode:
        perturbed = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert mode.ops >= 1 and not torch.equal(perturbed, plain)
    assert ((perturbed.float() - plain.float()).abs() <= 4 * 2**-8 * plain.float().abs().amax()).all()


@pytest.mark.parametrize(
    ("length", "mask_rows", "causal"),
    [(64, 64, False), (64, 1, False), (64, None, True), (64, None, False), (1, 1, False), (48, None, True)],
)
def test_the_math_attention_reference_goes_through_the_queries_in_blocks(length, mask_rows, causal):
    """The reference of a fused attention, its queries in blocks of about head_dim x seq / keys
    rows, equals the math attention over all queries at once (float64 inputs: a wider
    reference's own precision), for a mask per query, one mask for every query, and causal."""
    g = torch.Generator().manual_seed(length)
    q = torch.randn(1, 4, length, 8, generator=g, dtype=torch.float32)
    k, v = (torch.randn(1, 2, 64, 8, generator=g, dtype=torch.float32) for _ in range(2))
    mask = None if mask_rows is None else torch.randn(1, 1, mask_rows, 64, generator=g)
    func = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    blocked = attention_reference(func, (q, k, v, 0.0, causal), {"attn_mask": mask})
    whole, _ = torch.ops.aten._scaled_dot_product_attention_math(
        q.double(), k.double(), v.double(), None if mask is None else mask.double(), 0.0, causal, enable_gqa=True
    )
    assert blocked.dtype == torch.float64 and torch.allclose(blocked, whole, rtol=1e-12, atol=1e-12)
    assert query_block(length, 8, 64) == max(1, length * 8 // 64)  # several blocks whenever length > 8


def _splitmix64(key, counter):
    """SplitMix64's output for ``counter`` of the stream ``key``, in Python integers."""
    z = (key + (counter + 1) * 0x9E3779B97F4A7C15) % 2**64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
    return z ^ (z >> 31)


def _plain_another_rounding(result, wide, generator, jitter, scale, pull=None):
    """The rule written plainly, out of place (the oracle of the in-place code): each
    element e's 15 random bits the (e % 4)-th 16-bit field of SplitMix64's output for
    counter e // 4 of a 62-bit key drawn from the generator, its lowest bit the sign (unused
    with ``pull``), the other 14 a uniform number at the middle of one of 2^14 steps."""
    n = wide.numel()
    key = int(torch.randint(0, 2**62, (1,), generator=generator))
    words = [_splitmix64(key, c) for c in range((n + 3) // 4)]
    bits = torch.tensor([words[e // 4] >> (16 * (e % 4)) & 0x7FFF for e in range(n)]).view(wide.shape)
    sign = (bits % 2).to(wide.dtype) * 2 - 1
    uniform = ((bits // 2).to(wide.dtype) + 0.5) / 2**14
    error = result.to(wide.dtype) - wide
    if pull is None:
        point = torch.where(torch.isfinite(error), wide + sign * error * scale, wide)
    else:  # the point between the result and wide (an infinite result kept)
        f = scale * pull
        point = result.to(wide.dtype) * f + wide * (1 - f) if f != 1 else result.to(wide.dtype)
    if jitter:
        u = rounding.unit_roundoff(result.dtype) * scale
        return (point * (1 + u * (uniform * 2 - 1))).to(result.dtype)
    narrow = result.dtype
    nearest = point.to(narrow)
    back = nearest.to(point.dtype)
    toward = torch.where(back < point, torch.full_like(nearest, float("inf")), torch.full_like(nearest, -float("inf")))
    other = torch.nextafter(nearest, toward)
    p_other = ((point - back).abs() / (other.to(point.dtype) - back).abs()).nan_to_num(0.0).clamp(0, 1)
    by_closeness = torch.where((uniform < p_other) & torch.isfinite(other) & (back != point), other, nearest)
    # in dtype's normal range (and at zero): away from zero where the draw reaches past the
    # point's distance from its neighbour toward zero
    info = torch.finfo(narrow)
    size = point.abs()
    normal = (size <= info.max) & ((size >= info.tiny) | (size == 0) | (narrow == torch.bfloat16))
    zero_ward = torch.where(back.abs() <= size, nearest, torch.nextafter(nearest, torch.zeros_like(nearest)))
    away = torch.nextafter(zero_ward, torch.where(point < 0, -float("inf"), float("inf")).to(narrow))
    fraction = (size - zero_ward.to(point.dtype).abs()) / (away.to(point.dtype) - zero_ward.to(point.dtype)).abs()
    drop = {torch.bfloat16: 16, torch.float16: 13, torch.float32: 29}[narrow]
    draw = uniform if drop > 14 else (bits // 2 // 2 ** (14 - drop)).to(point.dtype) / 2**drop
    by_bits = torch.where(draw >= 1 - fraction, away, zero_ward)
    return torch.where(normal, by_bits, by_closeness)


PAIRS = [(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.float64)]


@pytest.mark.parametrize("block", [rounding.ROUNDING_BLOCK, 999, 1000])
@pytest.mark.parametrize(
    ("jitter", "pull", "scale"), [(False, None, 2.0), (True, None, 2.0), (False, 0.5, 2.0), (False, 0.5, 1.0)]
)
@pytest.mark.parametrize(("narrow", "wide"), PAIRS)
def test_another_rounding_in_place_draws_what_the_plain_rule_draws(
    monkeypatch, narrow, wide, jitter, pull, scale, block
):
    """In place, and in blocks (the same draws as the whole, the generator left where the
    whole leaves it)."""
    monkeypatch.setattr(rounding, "ROUNDING_BLOCK", block)
    g = torch.Generator().manual_seed(1)
    exact = 10 * torch.randn(5000, generator=g, dtype=torch.float64).to(wide)
    exact[::97] = 0
    exact[5], exact[7], exact[9] = float("inf"), float("nan"), 1e-40
    result = (exact * (1 + 1e-3 * torch.randn(5000, generator=g, dtype=wide))).to(narrow)
    mine, plain = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    got = rounding.another_rounding(result.view(50, 100), exact.view(50, 100), mine, jitter, scale, pull=pull).view(-1)
    want = _plain_another_rounding(result, exact, plain, jitter, scale, pull)
    assert torch.equal(torch.rand(4, generator=mine), torch.rand(4, generator=plain))
    assert got.dtype == narrow
    assert torch.equal(got.float().nan_to_num(123.0), want.float().nan_to_num(123.0))
    assert not torch.equal(got, result)  # it did move the result


def test_wider_arithmetic_widens_a_convolution_that_checks_its_operands_first():
    """A depthwise causal conv1d (Mamba's) on a widened input: the composite checks that its
    input and bias agree before any op runs, so its operands are widened where it is called."""
    from pytest_layerparity.noise.wider import WiderArithmetic

    conv = torch.nn.Conv1d(8, 8, 4, groups=8, padding=3)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        want = torch.nn.functional.conv1d(x, conv.weight.double(), conv.bias.double(), padding=3, groups=8)
        with WiderArithmetic(torch.float64):
            narrow = x.float()  # made float64 by the mode: exact
            got = torch.nn.functional.conv1d(narrow, conv.weight, conv.bias, padding=3, groups=8)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_wider_arithmetic_makes_a_float_fill_of_the_default_dtype_in_the_wider_one():
    """XGLM masks with ``torch.full((), torch.finfo(weights.dtype).min)``: under the float64
    pass the weights are float64, and float64's min does not fit the float32 default."""
    from pytest_layerparity.noise.wider import WiderArithmetic

    x = torch.randn(3, 4)
    with WiderArithmetic(torch.float64):
        wide = x * 2.0
        floor = torch.full((), torch.finfo(wide.dtype).min)
        masked = torch.max(wide, floor)
        count = torch.full((2,), 5)  # an int fill keeps its own dtype
    assert wide.dtype == floor.dtype == masked.dtype == torch.float64
    assert floor.item() == torch.finfo(torch.float64).min
    assert count.dtype == torch.int64
    torch.testing.assert_close(masked, x.double() * 2.0, rtol=0, atol=0)


def test_broken_ties_take_other_equal_candidates_and_the_same_values():
    scores = torch.tensor([[0.0, 2.0, 0.0, 0.0, 0.0, -1.0], [3.0, 1.0, 2.0, 0.5, 0.25, 0.125]])
    plain = scores.topk(3, dim=-1)
    chosen = set()
    for seed in range(12):
        with PerturbedArithmetic(seed, break_ties=True):
            values, indices = torch.topk(scores, 3, dim=-1)
        assert torch.equal(values, plain.values)
        assert torch.equal(scores.gather(-1, indices), values)  # each index is a candidate of that value
        assert torch.equal(indices[1], plain.indices[1])  # no tie: the one choice
        assert indices[0, 0] == 1 and set(indices[0, 1:].tolist()) <= {0, 2, 3, 4}
        chosen.add(tuple(sorted(indices[0, 1:].tolist())))
    assert len(chosen) > 1  # other runs take other equal candidates
    with PerturbedArithmetic(0):  # by default a run takes what topk takes
        assert torch.equal(torch.topk(scores, 3, dim=-1).indices, plain.indices)


def test_breaking_ties_leaves_the_arithmetic_as_it_was():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    with PerturbedArithmetic(5):
        plain = (x @ x.T).softmax(-1)
    with PerturbedArithmetic(5, break_ties=True):
        scores = (x @ x.T).softmax(-1)
        scores.topk(4, dim=-1)
        again = (x @ x.T).softmax(-1)
    with PerturbedArithmetic(5):
        (x @ x.T).softmax(-1)
        second = (x @ x.T).softmax(-1)
    assert torch.equal(scores, plain) and torch.equal(again, second)


def test_a_sixteen_bit_result_is_its_float32_result_rounded_once():
    """Under the perturbation a 16-bit op's result is taken from the float32 result the
    perturbation computes anyway (what a kernel that computes in float32 and rounds once
    gives); a float32 op, mixed dtypes, a dtype of the op's own, an in-place or out= variant
    and two results run as they are."""
    from pytest_layerparity.noise.perturb import _rounded_wide_result

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 16, generator=g), torch.randn(16, 4, generator=g)
    mm, silu = torch.ops.aten.mm.default, torch.ops.aten.silu.default
    for dtype in (torch.bfloat16, torch.float16):
        x, y = a.to(dtype), b.to(dtype)
        wide = x.float() @ y.float()
        got = _rounded_wide_result(mm, (x, y), {}, [wide])
        assert got is not None and got.dtype == dtype and torch.equal(got, wide.to(dtype))
        got = _rounded_wide_result(silu, (x,), {}, [torch.nn.functional.silu(x.float())])
        assert got is not None and torch.equal(got, torch.nn.functional.silu(x.float()).to(dtype))
        assert _rounded_wide_result(torch.ops.aten.mm.out, (x, y), {"out": wide.to(dtype)}, [wide]) is None
        assert _rounded_wide_result(torch.ops.aten.add_.Tensor, (x, x), {}, [2 * x.float()]) is None
        assert _rounded_wide_result(mm, (x, b), {}, [wide]) is None
        own_dtype = {"dtype": torch.float32}
        assert _rounded_wide_result(torch.ops.aten.sum.dim_IntList, (x, [1]), own_dtype, [x.sum(1)]) is None
        two = list(torch.var_mean(x.float()))
        assert _rounded_wide_result(torch.ops.aten.var_mean.correction, (x,), {}, two) is None
    assert _rounded_wide_result(mm, (a, b), {}, [a.double() @ b.double()]) is None
    assert _rounded_wide_result(mm, (a.bfloat16(), b.bfloat16()), {}, None) is None


def test_random_halves_are_uniform_15_bit_draws_the_same_in_blocks():
    g = torch.Generator().manual_seed(3)
    bits = draws.random_halves(200001, g, torch.device("cpu"))
    assert bits.shape == (200001,) and bits.dtype == torch.int16
    assert int(bits.min()) >= 0 and int(bits.max()) < 2**15
    assert (bits & 1).double().mean().item() == pytest.approx(0.5, abs=0.01)
    assert (bits >> 1).double().mean().item() == pytest.approx((2**14 - 1) / 2, rel=0.01)
    whole = draws.random_halves(1000, torch.Generator().manual_seed(4), torch.device("cpu"))
    parts = torch.Generator().manual_seed(4)
    blocks = torch.cat([draws.random_halves(n, parts, torch.device("cpu")) for n in (400, 600)])
    assert torch.equal(whole, blocks)


@pytest.mark.parametrize("byteorder", ["little", "big"])
def test_counter_halves_are_splitmix64_fields_the_same_in_any_block(monkeypatch, byteorder):
    monkeypatch.setattr(draws.sys, "byteorder", byteorder)
    key = draws.counter_key(torch.Generator().manual_seed(5))
    assert 0 <= key < 2**62
    got = draws.counter_halves(key, 7, 31)
    assert got.dtype == torch.int16
    assert got.tolist() == [_splitmix64(key, e // 4) >> (16 * (e % 4)) & 0x7FFF for e in range(7, 31)]
    whole = draws.counter_halves(key, 0, 1001)
    assert torch.equal(
        torch.cat([draws.counter_halves(key, a, min(a + 333, 1001)) for a in range(0, 1001, 333)]), whole
    )
    many = draws.counter_halves(key, 0, 400001)
    assert int(many.min()) >= 0 and int(many.max()) < 2**15
    assert (many & 1).double().mean().item() == pytest.approx(0.5, abs=0.005)
    steps = (many >> 1).long()
    counts = torch.bincount(steps, minlength=2**14).double()
    expected = many.numel() / 2**14
    assert ((counts - expected) ** 2 / expected).sum().item() / (2**14 - 1) == pytest.approx(1.0, abs=0.05)
    lagged = torch.corrcoef(torch.stack([steps[:-1].double(), steps[1:].double()]))[0, 1].item()
    assert abs(lagged) < 0.01
    other = draws.counter_halves(key + 1, 0, 400001)  # a neighbouring key: another stream
    assert abs(torch.corrcoef(torch.stack([many.double(), other.double()]))[0, 1].item()) < 0.01


def test_a_bfloat16_matmul_on_the_cpu_is_widened_in_bfloat16_arithmetic_alone():
    """On the CPU, oneDNN's bfloat16 mode is on for a matmul of bfloat16 operands alone (it
    holds them exactly), and is put back after; float16 and float32 operands (which it would
    round) and other ops leave the setting as it was."""
    setting = torch.backends.mkldnn.matmul
    before = setting.fp32_precision
    a = torch.randn(4, 8, dtype=torch.bfloat16)
    mm = torch.ops.aten.mm.default
    with exact_fast_matmul(mm, (a, a.T), {}):
        assert setting.fp32_precision == "bf16"
    assert setting.fp32_precision == before
    for func, args in (
        (mm, (a.half(), a.half().T)),
        (mm, (a.float(), a.float().T)),
        (torch.ops.aten.add.Tensor, (a, a)),
    ):
        with exact_fast_matmul(func, args, {}):
            assert setting.fp32_precision == before


def test_the_fast_float32_result_of_bfloat16_operands_on_the_cpu_is_the_float32_one():
    """The widened bfloat16 operands' product under oneDNN's bfloat16 mode is the float32 one
    up to its summation order: each element within a few float32 roundings of the float64
    result, and its bfloat16 rounding the float64 result's as often as the IEEE product's."""
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(256, 1024, generator=gen).bfloat16()
    b = torch.randn(1024, 512, generator=gen).bfloat16()
    exact = a.double() @ b.double()
    ieee = a.float() @ b.float()
    with exact_fast_matmul(torch.ops.aten.mm.default, (a, b), {}):
        fast = a.float() @ b.float()
    bound = 1024 * 2**-24 * (a.double().abs() @ b.double().abs())
    assert bool(((fast.double() - exact).abs() <= bound).all())
    agree = [(r.bfloat16() == exact.bfloat16()).double().mean().item() for r in (ieee, fast)]
    assert agree[1] > agree[0] - 1e-3, agree


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tf32_gives_the_float32_result_of_sixteen_bit_operands_on_cuda(dtype):
    """A 16-bit matmul's wide result under TF32 is its IEEE float32 result up to the float32
    summation order (TF32 holds 16-bit operands exactly), where TF32 on float32 operands is
    off by TF32's rounding of them: the context is on only for the first."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(256, 1024, generator=gen, device="cuda").to(dtype)
    b = torch.randn(1024, 512, generator=gen, device="cuda").to(dtype)
    ieee = a.double() @ b.double()
    mm = torch.ops.aten.mm.default
    with exact_fast_matmul(mm, (a, b), {}):
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        wide = a.float() @ b.float()
    scale = ieee.abs().max().item()
    assert (wide.double() - ieee).abs().max().item() < 1e-5 * scale
    x, y = a.float() + 1e-3 * torch.randn(a.shape, generator=gen, device="cuda"), b.float()
    with exact_fast_matmul(mm, (x, y), {}):
        kept = x @ y
    assert (kept.double() - x.double() @ y.double()).abs().max().item() < 1e-5 * scale
    before = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        rounded = x @ y
    finally:
        torch.backends.cuda.matmul.fp32_precision = before
    assert (rounded.double() - x.double() @ y.double()).abs().max().item() > 1e-4 * scale


def _row_scale_error(y: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Each row's scale error (its least-squares factor against the exact rows, less 1)."""
    return (y.double() * exact).sum(-1) / (exact * exact).sum(-1) - 1


def test_a_float16_layer_norm_is_computed_in_float16_in_some_runs_alone():
    """Half the runs of a float16 layer norm compute its statistics in float16 (each row's
    scale then off by a float16 rounding shared by the row, as XLA's lowering gives); the
    others as torch's kernel does, in float32. A bfloat16 layer norm takes float32 statistics
    either way: its rows' scale stays within a fraction of a rounding. Where runs are stacked,
    each run draws its own way."""
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2048, 64, generator=gen) + 0.5).half()
    xd = x.double()
    exact = (xd - xd.mean(-1, keepdim=True)) / xd.var(-1, unbiased=False, keepdim=True).sqrt()
    spreads = []
    for seed in range(8):
        with PerturbedArithmetic(seed):
            y = torch.nn.functional.layer_norm(x, (64,), None, None, 1e-12)
        spreads.append(_row_scale_error(y, exact).std().item() * 2**11)
    wide, narrow = [v for v in spreads if v > 0.5], [v for v in spreads if v < 0.2]
    assert len(wide) + len(narrow) == 8 and wide and narrow, spreads
    for seed in range(4):
        with PerturbedArithmetic(seed):
            y = torch.nn.functional.layer_norm(x.bfloat16(), (64,), None, None, 1e-12)
        assert _row_scale_error(y, exact).std().item() * 2**8 < 0.2
    mixed = 0
    for seed in range(4):
        with PerturbedArithmetic(seed, samples=4):
            y = torch.nn.functional.layer_norm(x.view(4, 512, 64), (64,), None, None, 1e-12)
        runs = [_row_scale_error(r, e).std().item() * 2**11 for r, e in zip(y, exact.view(4, 512, 64), strict=True)]
        assert all(v > 0.5 or v < 0.2 for v in runs), runs
        mixed += any(v > 0.5 for v in runs) and any(v < 0.2 for v in runs)
    assert mixed  # P(a call of 4 runs all one way) = 1/8


def test_layer_norm_in_own_dtype_is_the_layer_norm_within_float16_rounding():
    from pytest_layerparity.noise.algorithms import layer_norm_in_own_dtype

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 32, generator=gen).half()
    w, b = (1 + 0.1 * torch.randn(32, generator=gen)).half(), (0.1 * torch.randn(32, generator=gen)).half()
    out, mean, rstd = layer_norm_in_own_dtype(x, (32,), w, b, 1e-5)
    ref, ref_mean, ref_rstd = torch.ops.aten.native_layer_norm(x.float(), [32], w.float(), b.float(), 1e-5)
    assert out.dtype == torch.float16 and mean.shape == ref_mean.shape and rstd.shape == ref_rstd.shape
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    assert not torch.equal(out, ref.half())  # computed in float16: not the float32 result rounded


def test_layer_norm_in_own_dtype_takes_one_pass_statistics_summed_in_float16():
    """As XLA's batch-norm expansion: on rows whose mean is large against their spread the
    one-pass variance, summed pairwise in float16, cancels: each row's scale error is several
    float16 units (XLA measured 3.8), where a two-pass variance keeps it within one (0.5)."""
    from pytest_layerparity.noise.algorithms import _pairwise_sum, layer_norm_in_own_dtype

    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(1024, 128, generator=gen, dtype=torch.float64) + 2).half()
    out, _, _ = layer_norm_in_own_dtype(x, (128,), None, None, 1e-5)
    exact = torch.nn.functional.layer_norm(x.double(), (128,), eps=1e-5)
    scale = _row_scale_error(out.double(), exact) * 2**11
    assert 2.0 < scale.std().item() < 6.0
    assert torch.isfinite(out).all()
    odd = torch.arange(7, dtype=torch.float16).expand(3, 7)
    assert _pairwise_sum(odd).tolist() == [21.0, 21.0, 21.0]  # an odd element out is carried


def test_layer_norm_in_own_dtype_keeps_rows_whose_float16_sums_overflow():
    """A row of 2048 whose rms is 8 sums its squares past float16's range (65504): its
    statistics come from wider sums, not a 1/std of 0 that zeroes the row (half the runs of
    such a layer were garbage, and its envelope as wide as garbage); rows within range keep
    their float16 statistics."""
    from pytest_layerparity.noise.algorithms import layer_norm_in_own_dtype

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 2048, generator=gen)
    x[:2] *= 8
    x = x.half()
    out, _, rstd = layer_norm_in_own_dtype(x, (2048,), None, None, 1e-5)
    ref = torch.nn.functional.layer_norm(x.double(), (2048,), eps=1e-5)
    assert torch.isfinite(out).all() and torch.isfinite(rstd).all() and (rstd > 0).all()
    err = ((out.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).tolist()
    assert max(err) < 2e-3, err
    assert torch.isinf((x[:2].float() ** 2).sum(-1).half()).all()  # the rows that overflow


def test_layer_norm_in_own_dtype_takes_the_mean_with_one_over_the_width_rounded():
    """As XLA's batch-norm expansion: the sums are multiplied by 1/width in float16, which is
    not exact at a width that is not a power of two (768: 1/768 is 0.5 float16 units low),
    so the variance comes out that much low on centred rows and every row leans the other way
    by about a quarter unit (torch-xla's float16 LayerNorm of width 768 reads +0.3); a sum
    divided by the width leans by under 0.1."""
    from pytest_layerparity.noise.algorithms import _windowed_sum, layer_norm_in_own_dtype

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2048, 768, generator=gen).half()
    out, mean, _ = layer_norm_in_own_dtype(x, (768,), None, None, 1e-5)
    inverse = torch.tensor(1 / 768, dtype=torch.float16)
    assert torch.equal(mean.reshape(-1), _windowed_sum(x, False) * inverse)
    exact = torch.nn.functional.layer_norm(x.double(), (768,), eps=1e-5)
    lean = _row_scale_error(out.double(), exact).mean().item() * 2**11
    assert 0.15 < lean < 0.4, lean


def test_a_float16_reciprocal_square_root_rounds_as_xla_even_in_a_perturbed_run():
    """XLA's float16 rsqrt is a square root and a reciprocal each rounded to float16 (a
    quarter of the inputs one ulp off the correctly rounded result); a perturbed run keeps it
    as it rounds, so rows that share a variance keep its error's sign."""
    from pytest_layerparity.noise.algorithms import reciprocal_sqrt_rounded_twice
    from pytest_layerparity.noise.perturb import PerturbedArithmetic

    bits = torch.arange(0x3C00, 0x4400, dtype=torch.int32).to(torch.int16)  # every float16 in [1, 4)
    x = bits.view(torch.float16)
    plain = reciprocal_sqrt_rounded_twice(x)
    assert torch.equal(plain, (1 / x.float().sqrt().half().float()).half())
    assert 0.1 < (plain != torch.rsqrt(x.float()).half()).float().mean().item() < 0.5
    with PerturbedArithmetic(seed=3):
        assert torch.equal(reciprocal_sqrt_rounded_twice(x), plain)
        assert not torch.equal(torch.sqrt(x), torch.sqrt(x.float()).half())  # other ops are perturbed


def test_a_perturbed_run_keeps_the_float16_norms_statistics_as_xla_rounds_them():
    """Under perturbation the own-dtype layer norm's mean and 1/std are XLA's, the same in
    every run (rows alike then lean alike, as on torch-xla); what follows them is perturbed,
    so the runs' outputs differ."""
    from pytest_layerparity.noise.algorithms import layer_norm_in_own_dtype
    from pytest_layerparity.noise.perturb import PerturbedArithmetic

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(64, 512, generator=gen).half()
    _, mean, rstd = layer_norm_in_own_dtype(x, (512,), None, None, 1e-5)
    outs = []
    for seed in (1, 2):
        with PerturbedArithmetic(seed):
            out, run_mean, run_rstd = layer_norm_in_own_dtype(x, (512,), None, None, 1e-5)
        assert torch.equal(run_mean, mean) and torch.equal(run_rstd, rstd)
        outs.append(out)
    assert not torch.equal(outs[0], outs[1])


def test_layer_norm_in_own_dtype_leans_by_the_scale_it_is_given():
    """A lean far under one float16 ulp still moves the rows' mean scale by itself: each
    normalised value is scaled before it is rounded, so over many values the roundings carry
    it; without a lean the emulation leans by less than 0.05 units."""
    from pytest_layerparity.noise.algorithms import layer_norm_in_own_dtype

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4096, 64, generator=gen).half()
    exact = torch.nn.functional.layer_norm(x.double(), (64,), eps=1e-5)
    plain, _, _ = layer_norm_in_own_dtype(x, (64,), None, None, 1e-5)
    lean = torch.tensor(0.3 * 2**-11)
    leaning, _, _ = layer_norm_in_own_dtype(x, (64,), None, None, 1e-5, lean=lean)
    base = _row_scale_error(plain.double(), exact).mean().item() * 2**11
    moved = _row_scale_error(leaning.double(), exact).mean().item() * 2**11
    assert abs(base) < 0.05
    assert 0.2 < moved - base < 0.4


def test_a_float16_layer_norm_in_its_own_dtype_leans_one_way_per_run():
    """The runs that compute a float16 layer norm in float16 each lean by one scale drawn for
    the run (a backend lowers every norm one way), within OWN_DTYPE_NORM_LEAN units; the runs
    differ."""
    from pytest_layerparity.noise.algorithms import OWN_DTYPE_NORM_LEAN

    mode = _AlwaysOther(seed=5, samples=4)
    x = torch.zeros(8, 3, 16, dtype=torch.float16)
    lean = mode._per_run(x, OWN_DTYPE_NORM_LEAN * 2**-11)
    assert lean.shape == (8, 1, 1) and lean.dtype == torch.float32
    runs = lean.view(4, 2)
    assert torch.equal(runs[:, 0], runs[:, 1])  # a run's rows share its draw
    assert len(set(runs[:, 0].tolist())) == 4
    assert lean.abs().max().item() <= OWN_DTYPE_NORM_LEAN * 2**-11
    gen = torch.Generator().manual_seed(6)
    rows = torch.randn(4 * 2048, 64, generator=gen).half()
    with mode:
        y = torch.nn.functional.layer_norm(rows, (64,), None, None, 1e-5)
    exact = torch.nn.functional.layer_norm(rows.double(), (64,), eps=1e-5)
    pairs = zip(y.view(4, 2048, 64), exact.view(4, 2048, 64), strict=True)
    leans = [_row_scale_error(r, e).mean().item() * 2**11 for r, e in pairs]
    assert max(leans) - min(leans) > 0.05, leans  # the runs lean apart


def test_a_bfloat16_layer_norm_in_its_own_dtype_rounds_three_times_on_float32_statistics():
    """As XLA's lowering: the normalised values from float32 statistics, the scaled ones and
    the shifted ones each rounded to bfloat16 (torch-xla errs 1.7-1.9 times eager there); a
    run that takes it errs more than one that takes the decomposition (rounded once)."""
    from pytest_layerparity.noise.algorithms import layer_norm_in_own_dtype

    gen = torch.Generator().manual_seed(8)
    x = (2 * torch.randn(256, 512, generator=gen)).bfloat16()
    w, b = (1 + 0.3 * torch.randn(512, generator=gen)).bfloat16(), (0.2 * torch.randn(512, generator=gen)).bfloat16()
    out, mean, rstd = layer_norm_in_own_dtype(x, (512,), w, b, 1e-5)
    var, mu = torch.var_mean(x.float(), -1, correction=0, keepdim=True)
    normalised = ((x.float() - mu) * torch.rsqrt(var + 1e-5)).bfloat16()
    assert torch.equal(out, normalised * w + b) and mean.shape == rstd.shape == (256, 1)
    exact = torch.nn.functional.layer_norm(x.double(), (512,), w.double(), b.double(), 1e-5)
    once = float((exact.bfloat16().double() - exact).norm())
    with _AlwaysOther(seed=1):
        own = torch.nn.functional.layer_norm(x, (512,), w, b, 1e-5)
    with _NeverOther(seed=1):
        standard = torch.nn.functional.layer_norm(x, (512,), w, b, 1e-5)
    own_error, standard_error = (float((y.double() - exact).norm()) / once for y in (own, standard))
    assert own_error > 1.4 * standard_error and standard_error < 2, (own_error, standard_error)


class _AlwaysOther(PerturbedArithmetic):
    """The perturbation with every drawn alternative taken (to test the alternatives)."""

    def _drawn(self, args, dtypes, other, standard, key=None):
        floating = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        return other() if all(a.dtype in dtypes for a in floating) else standard()


class _NeverOther(PerturbedArithmetic):
    """The perturbation with no drawn alternative taken."""

    def _drawn(self, args, dtypes, other, standard, key=None):
        return standard()


def test_a_sixteen_bit_linear_with_a_bias_may_round_its_product_first():
    """The alternative of a 16-bit addmm rounds the product to nearest and adds the bias (a
    second rounding), as XLA's dot-then-add does: within the add's perturbation (1.5 ulp at
    most) of that two-step result, where one-step rounding lands elsewhere; float32 operands
    keep the one-step addmm. Half the runs draw it (as the other alternatives)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(256, 64, generator=gen).bfloat16()
    w = torch.randn(32, 64, generator=gen).bfloat16()
    b = torch.randn(32, generator=gen).bfloat16()
    two_step = ((x.float() @ w.float().T).bfloat16().float() + b.float()).double()
    one_step = (x.double() @ w.double().T + b.double()).bfloat16()
    with _AlwaysOther(0):
        out = torch.nn.functional.linear(x, w, b)
    assert bool((ulps(out, two_step.bfloat16()) <= 2).all())  # 1.5 ulp from the exact sum, 2 from its rounding
    assert (out != one_step).double().mean().item() > (two_step.bfloat16() != one_step).double().mean().item() / 2
    with _AlwaysOther(0):
        wide = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert (wide.double() - (x.double() @ w.double().T + b.double())).abs().max().item() < 1e-4
    taken = []
    for seed in range(8):
        with PerturbedArithmetic(seed) as mode:
            mode._drawn = lambda args, dtypes, other, standard: taken.append(1) or standard()
            torch.nn.functional.linear(x, w, b)
    assert len(taken) == 8  # every bfloat16 addmm goes through the draw


def test_a_run_takes_an_alternative_for_every_such_op_or_for_none():
    """A backend lowers every linear layer one way: a run draws each alternative once and
    keeps it for all its ops (stacked runs, once each); over seeds both ways occur."""
    gen = torch.Generator().manual_seed(6)
    x, w, b = (torch.randn(*s, generator=gen).bfloat16() for s in ((8, 16), (16, 16), (16,)))
    seen = set()
    for seed in range(8):
        with PerturbedArithmetic(seed) as mode:
            torch.nn.functional.linear(torch.nn.functional.linear(x, w, b), w, b)
        (pick,) = mode._picks.values()
        assert pick.shape == (1,)
        seen.add(bool(pick[0]))
    assert seen == {True, False}
    with PerturbedArithmetic(3, samples=4) as mode:
        torch.nn.functional.linear(torch.nn.functional.linear(x.repeat(4, 1), w, b), w, b)
    (pick,) = mode._picks.values()
    assert pick.shape == (4,)


def test_a_16_bit_product_is_rounded_stochastically_and_an_approximated_function_jittered():
    """A bfloat16 product (computed in float32 and rounded once by any kernel) lands on one of
    the exact value's two neighbours with 1.5 times a correct rounding's squared error; a bfloat16
    exp (kernels approximate it) reaches beyond them, at about four times that error."""
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(256, 256, generator=g).bfloat16(), torch.randn(256, 256, generator=g).bfloat16()
    measured = {}
    for name, op, exact in (("mul", lambda: a * b, a.double() * b.double()), ("exp", a.exp, a.double().exp())):
        with PerturbedArithmetic(7):
            out = op()
        nearest = exact.to(torch.bfloat16)
        neighbours = _on_neighbours(out, exact).double().mean().item()
        squared = ((out.double() - exact).pow(2).mean() / (nearest.double() - exact).pow(2).mean()).item()
        measured[name] = (neighbours, squared)
    assert measured["mul"][0] == 1.0 and 1.35 < measured["mul"][1] < 1.65
    assert measured["exp"][0] < 0.95 and measured["exp"][1] > 3.0


def test_a_pointwise_ops_16_bit_error_is_a_function_of_its_one_tensors_values_in_each_run():
    """A bfloat16 GELU, or a scale of one tensor, errs by the same amount wherever its input
    takes the same value within a run (any kernel's error on it is a function of its input),
    another amount in another run, and in each of several runs stacked in one call; a product
    of two tensors (here the same scale as a tensor) draws each element's error afresh."""
    values = torch.randn(64, generator=torch.Generator().manual_seed(8)).bfloat16()
    x = values[torch.randint(0, 64, (2, 4096), generator=torch.Generator().manual_seed(9))]

    def outputs_per_value(inputs: torch.Tensor, outputs: torch.Tensor) -> int:
        return max(len(set(outputs[inputs == v].tolist())) for v in values.unique())

    with PerturbedArithmetic(1):
        one, scaled = torch.nn.functional.gelu(x), x * 0.7
        product = x * torch.full_like(x, 0.7)  # the same values, from two tensors
    with PerturbedArithmetic(2):
        two = torch.nn.functional.gelu(x)
    with PerturbedArithmetic(1, samples=2):
        stacked = torch.nn.functional.gelu(x)
    assert outputs_per_value(x, one) == 1 and outputs_per_value(x, two) == 1 and not torch.equal(one, two)
    assert outputs_per_value(x, scaled) == 1 and not torch.equal(scaled, (x.float() * 0.7).bfloat16())
    assert outputs_per_value(x[0], stacked[0]) == 1 and outputs_per_value(x[1], stacked[1]) == 1
    assert outputs_per_value(torch.cat([x[0], x[1]]), torch.cat([stacked[0], stacked[1]])) > 1  # runs differ
    assert outputs_per_value(x, product) > 1


def test_keyed_draws_of_one_run_follow_the_value():
    """A run alone draws the same at every element holding one value, whole or in blocks, and
    the first of two stacked runs draws as it does alone (its run index is 0); the second
    draws otherwise."""
    from pytest_layerparity.noise.functions import keyed_halves

    x = torch.randn(4, 250, generator=torch.Generator().manual_seed(11)).bfloat16()
    x[1] = x[0]
    alone = keyed_halves(x, "silu", 5)
    assert torch.equal(alone[:250], alone[250:500])
    assert torch.equal(torch.cat([keyed_halves(x, "silu", 5, 1, a, a + 300) for a in range(0, 1000, 300)]), alone)
    stacked = keyed_halves(torch.cat([x, x]), "silu", 5, samples=2)
    assert torch.equal(stacked[:1000], alone)
    assert (stacked[1000:] != alone).float().mean() > 0.9


def test_keyed_draws_are_the_same_drawn_in_blocks(monkeypatch):
    """A pointwise op's draws keyed by value are the same whether its result is rounded whole
    or in blocks (the CPU's blocks keep the temporaries small), for stacked runs too."""
    from pytest_layerparity.noise.functions import keyed_halves

    x = torch.randn(4, 250, generator=torch.Generator().manual_seed(10)).bfloat16()
    whole = keyed_halves(x, "gelu", 3, samples=2)
    assert torch.equal(torch.cat([keyed_halves(x, "gelu", 3, 2, a, a + 100) for a in range(0, 1000, 100)]), whole)
    outs = []
    for block in (1 << 18, 100):
        monkeypatch.setattr(rounding, "ROUNDING_BLOCK", block)
        with PerturbedArithmetic(3, samples=2):
            outs.append(torch.nn.functional.gelu(x))
            outs.append(torch.nn.functional.gelu(x.t()))  # a strided operand
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])


def _sharp_attention(runs: int, dtype: torch.dtype, size: float = 3.0, kv_heads: int = 2):
    """Queries, keys and values of ``runs`` stacked runs whose scores are large (a sharp
    softmax, where rounding the scores to 16 bits moves the output most)."""
    g = torch.Generator().manual_seed(8)
    q = size * torch.randn(1, 4, 24, 32, generator=g)
    k, v = (size * torch.randn(1, kv_heads, 24, 32, generator=g) for _ in range(2))
    return tuple(t.expand(runs, -1, -1, -1).to(dtype).contiguous() for t in (q, k, v))


def _eager(q, k, v):
    """transformers' eager attention, causal, grouped heads repeated."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(torch.ones(24, 24, dtype=torch.bool).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_half_the_runs_of_a_sixteen_bit_attention_compute_it_as_eager_attention(kv_heads):
    """Each run either rounds the fused kernel's result (scores held in float32) or computes the
    attention as transformers' eager attention does, scores and probabilities rounded to nearest
    in bfloat16, unperturbed: those runs' rows are eager attention's, bit for bit, and the
    others' error against the exact attention is several times smaller."""
    from pytest_layerparity.noise.algorithms import eager_attention

    runs = 8
    q, k, v = _sharp_attention(runs, torch.bfloat16, kv_heads=kv_heads)
    gqa = kv_heads != q.shape[1]
    with PerturbedArithmetic(1000, samples=runs) as run:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    picked = run._picks[(eager_attention.__code__, q.device)]
    assert 0 < int(picked.sum()) < runs
    fused = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True, enable_gqa=gqa
    )
    eager = _eager(q, k, v)
    eager_error = float((eager[0].double() - fused[0]).norm())
    for i in range(runs):
        error = float((out[i].double() - fused[i]).norm())
        assert torch.equal(out[i], eager[i]) if picked[i] else (error < 0.5 * eager_error), i


def test_an_eager_attention_that_overflows_keeps_the_fused_result():
    """float16 scores past 65504 are no rounding: those runs keep the fused kernel's output."""
    runs = 4
    q, k, v = _sharp_attention(runs, torch.float16, size=100.0, kv_heads=4)
    from pytest_layerparity.noise.algorithms import eager_attention

    with PerturbedArithmetic(1000, samples=runs) as run:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert run._picks[(eager_attention.__code__, q.device)].any()
    assert torch.isfinite(out).all()
    assert not torch.isfinite(torch.matmul(q, k.transpose(-2, -1))).all()  # the eager scores do overflow


def test_a_float32_decode_attention_sums_its_scores_in_order_in_the_same_runs():
    """A fused float32 attention of one query a run (a decode step's): in the runs that lower
    float32 matmuls as XLA's CPU backend does (those whose one-row linear with a bias sums in
    order), its scores carry an in-order sum's error, as XLA's do; so do a one-row batched
    matmul's (eager attention's scores). The drawn scores err about as an explicit in-order
    sum over the head does."""
    g = torch.Generator().manual_seed(21)
    q = torch.randn(1, 4, 1, 64, generator=g) * 6  # a sharp softmax: the scores' error shows
    k, v = torch.randn(1, 4, 97, 64, generator=g), torch.randn(1, 4, 97, 64, generator=g)
    x, bias = torch.randn(1, 256, generator=g), torch.randn(128, generator=g)
    w = torch.randn(256, 128, generator=g) / 16
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    eager = (F.scaled_dot_product_attention(q, k, v).double() - exact).norm().item()
    scores = _in_order_from_bias(q, k.transpose(-2, -1))  # one query's scores summed in order over the head
    looped = ((torch.softmax(scores.double() / 8, -1) @ v.double()).float().double() - exact).norm().item()
    assert looped > 1.5 * eager
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    drawn = in_order_scores_attention(op, (q.repeat(16, 1, 1, 1), k, v), {}, torch.arange(16), torch.Generator())
    assert drawn is not None
    size = (drawn.double() - exact).pow(2).sum((1, 2, 3)).mean().sqrt().item()
    assert 0.6 * looped < size < 1.6 * looped
    with PerturbedArithmetic(4, samples=8):
        runs = F.scaled_dot_product_attention(*(t.repeat(8, 1, 1, 1) for t in (q, k, v)))
        linear = torch.addmm(bias, x.repeat(8, 1), w)
        batched = q.repeat(8, 1, 1, 1).view(32, 1, 64) @ k.repeat(8, 1, 1, 1).transpose(-2, -1).reshape(32, 64, 97)
    wide = x.double() @ w.double() + bias.double()
    linear_sizes = [(linear[j].double() - wide[0]).norm().item() for j in range(8)]
    cut = (max(linear_sizes) + min(linear_sizes)) / 2
    took = [s > cut for s in linear_sizes]
    assert 0 < sum(took) < 8
    attention_sizes = [(runs[j : j + 1].double() - exact).norm().item() / eager for j in range(8)]
    in_order = [a for a, t in zip(attention_sizes, took, strict=True) if t]
    assert min(in_order) > max(a for a, t in zip(attention_sizes, took, strict=True) if not t)
    assert min(in_order) > 0.8 * looped / eager  # (eager's own error differs by CPU: 1.6-1.9 of it)
    exact_scores = (q.double() @ k.double().transpose(-2, -1)).view(4, 1, 97)
    per_run = [(batched[4 * j : 4 * j + 4].double() - exact_scores).norm().item() for j in range(8)]
    cut = (max(per_run) + min(per_run)) / 2
    assert [s > cut for s in per_run] == took
