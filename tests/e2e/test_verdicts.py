"""Noise-aware verdicts, MoE routing agreement, chained runs, bisection and reports."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from support import DEFAULT_MODEL, ROOT

sys.path.insert(0, str(ROOT / "fixtures"))
sys.path.insert(0, str(ROOT / "bench"))


@pytest.fixture(scope="module")
def bf16_store(tmp_path_factory):
    """bf16 goldens of the default model (made once for this module)."""
    from pytest_layerparity.options import make_settings
    from pytest_layerparity.session import LayerParitySession

    store = tmp_path_factory.mktemp("bf16") / "store"
    session = LayerParitySession(
        make_settings(gpu_golden=True, extract=True, model=str(DEFAULT_MODEL), golden_dir=str(store), dtype="bfloat16"),
        ROOT,
    )
    for i in range(6):
        session.extract_layer(i)
    return store


EPS_BUG_IN_LAYER_3 = """
import pytest

@pytest.hookimpl
def pytest_layerparity_build_target_layer(layer_idx, reference_layer, model_config, device):
    if layer_idx == 3:
        reference_layer.input_layernorm.variance_epsilon = 0.5
    return reference_layer.to(device)
"""


def _ini(pytester, model, store):
    pytester.makeini(f"[pytest]\nlayerparity_model = {model}\nlayerparity_golden_dir = {store}\n")


def test_correct_bf16_port_passes_isolated_and_chained_on_xla(pytester, bf16_store):
    """The seeds' table fails this correct port (max_abs_diff about 1 where a near-tie
    token routes to another expert); the default verdict passes it and says why."""
    _ini(pytester, DEFAULT_MODEL, bf16_store)
    result = pytester.runpytest("--xla", "--chain", "--parity-report", "rep")
    result.assert_outcomes(passed=14)  # 6 layers, 6 layers' decode steps, the chain, the whole model
    report = json.loads((pytester.path / "rep" / "report.json").read_text())
    flips = [
        t["metrics"].get("routing_near_tie_flipped", 0) for t in report["tests"] if "test_layer_parity" in t["nodeid"]
    ]
    assert sum(flips) >= 1  # near-tie routing flips happen, and are told apart from bugs
    table = pytester.runpytest("--xla", "--layers", "1", "--verdict", "table")
    table.assert_outcomes(failed=2)  # the prompt and the decode steps
    table.stdout.fnmatch_lines(["  max_abs_diff * <= 0.01 * FAIL"])


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "gemma2"])  # gemma2: sliding-window caches slide
def test_correct_bf16_ports_of_other_architectures_pass(pytester, kind):
    from tiny_models import make

    from pytest_layerparity.options import make_settings
    from pytest_layerparity.session import LayerParitySession

    model = make(kind, pytester.path / kind, num_layers=3)
    store = pytester.path / "store"
    session = LayerParitySession(
        make_settings(gpu_golden=True, extract=True, model=str(model), golden_dir=str(store), dtype="bfloat16"), ROOT
    )
    for i in range(3):
        session.extract_layer(i)
    _ini(pytester, model, store)
    result = pytester.runpytest("--xla", "--chain")
    result.assert_outcomes(passed=8)  # 3 layers, their decode steps, the chain, the whole model


PLANTS = {
    "positions off by one": "positions_off_by_one",
    "square projection transposed": "out_proj_transposed",
    "rotary halves swapped": "rotary_halves_swapped",
    "one head's output dropped": "head_dropped",
    "wrong expert scaling": "expert_scaling",
    "softmax router": "softmax_router",
}


def _plant_in_layer_2(pytester, plant: str) -> None:
    """A conftest whose port is the reference with ``plant`` (an expression over
    bench_verdicts' names: a function of the layer and its config) applied to layer 2."""
    pytester.makeconftest(
        f"""
        import sys
        sys.path.insert(0, {str(ROOT / "bench")!r})
        import pytest
        import bench_verdicts

        plant = bench_verdicts.{plant}

        @pytest.hookimpl
        def pytest_layerparity_build_target_layer(layer_idx, reference_layer, model_config, device):
            if layer_idx == 2:
                reference_layer = plant(reference_layer, model_config)
            return reference_layer.to(device)
        """
    )


@pytest.mark.parametrize("bug", list(PLANTS))
def test_planted_bugs_fail_that_layer(pytester, bf16_store, bug):
    _plant_in_layer_2(pytester, PLANTS[bug])
    _ini(pytester, DEFAULT_MODEL, bf16_store)
    result = pytester.runpytest("--target", "cpu", "--layers", "1-3", "-rA")
    failed = sorted(line.split()[1] for line in result.stdout.lines if line.startswith("FAILED "))
    expected = ["layerparity::test_layer_parity[layer_2]"]
    if bug != "positions off by one":  # rolling the positions of a one-token decode step changes nothing
        expected.insert(0, "layerparity::test_layer_decode_parity[layer_2]")
    assert failed == expected
    result.assert_outcomes(passed=6 - len(failed), failed=len(failed))


def test_goldens_hold_each_branch_and_a_bug_inside_one_fails_along_it(pytester, bf16_store):
    """Extraction keeps the attention's and the mixture of experts' outputs and each run's
    bias along them; a 2% scale of layer 2's attention output projection fails there along
    the attention's own output (in the prompt and in the decode steps), and JUnit carries that
    statistic and its range."""
    from pytest_layerparity.store.golden import GoldenStore

    entry = GoldenStore(bf16_store).load("layer_2")
    assert {k for k in entry.tensors if k.startswith("floor.branch.")} == {
        "floor.branch.self_attn",
        "floor.branch.mlp",
        "floor.branch.attention_temperature",
        "floor.branch.norm_epsilon",
    }
    assert entry.tensors["floor.branch.self_attn"].dtype == torch.bfloat16
    assert set(entry.envelope.branch_bias) == {"self_attn", "mlp", "attention_temperature", "norm_epsilon"}
    assert entry.envelope.samples == 12
    _plant_in_layer_2(pytester, "scaled_out_proj(1.02)")
    _ini(pytester, DEFAULT_MODEL, bf16_store)
    result = pytester.runpytest("--target", "cpu", "--layers", "2", "--junitxml", "j.xml")
    result.assert_outcomes(failed=2)  # the prompt and the decode steps
    result.stdout.fnmatch_lines(["*branch_bias_self_attn * in [[]*[]] * FAIL"])
    xml = (pytester.path / "j.xml").read_text()
    for name in ("branch_bias_self_attn", "branch_bias_mlp", "branch_bias_self_attn_low", "branch_bias_mlp_high"):
        assert f'name="{name}"' in xml


def test_a_gelu_models_goldens_keep_the_swaps_size_and_its_correct_port_passes(pytester):
    """Extraction of a GELU decoder (GPT-NeoX, float16) stores the direction of GELU's other
    form and the swap's size beside it; the correct port on torch-xla passes, its JUnit range
    along that direction widened by the float16 kernels' lean."""
    from tiny_models import make

    from pytest_layerparity.compare.floor import MOVE_PREFIX
    from pytest_layerparity.options import make_settings
    from pytest_layerparity.session import LayerParitySession
    from pytest_layerparity.store.golden import GoldenStore

    model = make("gpt_neox", pytester.path / "neox", num_layers=2)
    store = pytester.path / "store"
    settings = make_settings(gpu_golden=True, extract=True, model=str(model), golden_dir=str(store), dtype="float16")
    session = LayerParitySession(settings, ROOT)
    for i in range(2):
        session.extract_layer(i)
    entry = GoldenStore(store).load("layer_1")
    size = entry.tensors[MOVE_PREFIX + "gelu_form"]
    assert size.dim() == 0 and 0 < float(size) < 1e-2  # the forms differ by a small part of the output
    assert "gelu_form" in entry.envelope.branch_bias
    _ini(pytester, model, store)
    result = pytester.runpytest("--xla", "--layers", "0-1", "--junitxml", "j.xml")
    result.assert_outcomes(passed=4)  # 2 layers, their decode steps
    xml = (pytester.path / "j.xml").read_text()
    assert 'name="branch_bias_gelu_form_low"' in xml


def test_bisect_names_the_planted_layer(pytester, bf16_store):
    pytester.makeconftest(
        """
        import pytest

        @pytest.hookimpl
        def pytest_layerparity_build_target_layer(layer_idx, reference_layer, model_config, device):
            if layer_idx == 4:
                reference_layer.post_attention_layernorm.weight.data.mul_(1.5)
            return reference_layer.to(device)
        """
    )
    _ini(pytester, DEFAULT_MODEL, bf16_store)
    result = pytester.runpytest("--target", "cpu", "--bisect", "-k", "bisect")
    result.assert_outcomes(failed=1, deselected=13)
    result.stdout.fnmatch_lines(
        [
            "bisect 0-5: the chain first leaves tolerance at layer 4 (* chained range runs: 0-5 FAIL, *)",
        ]
    )
    text = result.stdout.str()
    runs = int(text.split("chained range runs")[0].rsplit("(", 1)[1])
    assert runs <= 4  # 1 + ceil(log2(6))


def test_a_chain_sees_a_layers_own_error_that_upstream_drift_would_hide(pytester, bf16_store):
    """RMSNorm epsilon 0.5 in layer 3 (bf16): against the accumulated drift of perturbed chains
    alone, the chain over 1-4 passed while the isolated layer 3 failed (noise ratio 9.0); the
    local check (layer 3 of the reference fed the target's own layer-3 input) fails it there,
    and bisection names it."""
    pytester.makeconftest(EPS_BUG_IN_LAYER_3)
    _ini(pytester, DEFAULT_MODEL, bf16_store)
    result = pytester.runpytest("--target", "cpu", "--layers", "1-4", "--chain", "--bisect", "-k", "chain or bisect")
    result.assert_outcomes(failed=2, deselected=8)
    result.stdout.fnmatch_lines(["chain 1-4: 1 of 4 layers leave tolerance; the first is layer 3"])
    rows = {line.split()[0]: line.split()[-1] for line in result.stdout.lines if line.startswith("  ") and line.split()}
    assert rows["noise_ratio"] == "ok"  # the accumulated drift hides layer 3's error
    assert rows["local_noise_ratio"] == "FAIL"  # its own computation, on the input it was given, does not
    result.stdout.fnmatch_lines(["bisect 1-4: the chain first leaves tolerance at layer 3 *"])


def test_reports_csv_html_and_offline_compare(pytester, bf16_store):
    pytester.makeconftest(EPS_BUG_IN_LAYER_3)
    _ini(pytester, DEFAULT_MODEL, bf16_store)
    result = pytester.runpytest("--target", "cpu", "--parity-report", "rep", "--save-outputs", "out")
    result.assert_outcomes(passed=11, failed=2)  # layer 3 fails in the prompt and in its decode steps
    rep = pytester.path / "rep"
    csv_text = (rep / "report.csv").read_text()
    assert csv_text.splitlines()[0].startswith("nodeid,layers,verdict,max_abs_diff,mean_abs_diff")
    assert len(csv_text.splitlines()) == 14
    report = {t["nodeid"].split("::")[-1]: t for t in json.loads((rep / "report.json").read_text())["tests"]}
    decode = report["test_layer_decode_parity[layer_3]"]
    assert decode["verdict"] == "fail" and decode["metrics"]["decode_steps"] == 2
    model = report["test_model_parity"]["metrics"]
    assert model["kl_divergence"] >= 0 and model["kl_divergence_limit"] > 0 and model["positions"] > 0
    page = (rep / "report.html").read_text()
    assert "First failing: test_layer_parity[layer_3] (layers 3)" in page
    assert "data:image/png;base64," in page
    from pytest_layerparity.__main__ import main

    assert main(["compare", str(bf16_store), str(pytester.path / "out"), "--report", str(pytester.path / "rep2")]) == 1
    offline = json.loads((pytester.path / "rep2" / "report.json").read_text())
    verdicts = {t["layers"]: t["verdict"] for t in offline["tests"]}
    assert verdicts == {"0": "pass", "1": "pass", "2": "pass", "3": "fail", "4": "pass", "5": "pass"}
    assert main(["compare", str(bf16_store), str(pytester.path / "out"), "--layer-pattern", "layer_[0-2]"]) == 0


def test_routing_agreement_tells_near_ties_from_flips():
    from pytest_layerparity.compare.routing_agreement import agreement

    golden = {
        "routing.gate.indices": torch.tensor([[0, 1], [2, 3], [0, 3]]),
        "routing.gate.logits": torch.tensor([[3.0, 2.0, 0.0, 0.0], [0.0, 0.0, 2.0, 1.0], [2.0, 0.0, 0.0, 1.0]]),
        "routing.gate.scores": torch.tensor([[3.0, 2.0, 0.0, 0.0], [0.0, 0.0, 2.0, 1.0], [2.0, 0.0, 0.0, 1.0]]),
        # exact scores: token 1's experts 3 and 1 are 1e-3 apart, token 2's experts 3 and 1 are 1.0 apart
        "floor.routing.gate.scores": torch.tensor(
            [[3.0, 2.0, 0.0, 0.0], [0.0, 0.999, 2.0, 1.0], [2.0, 0.0, 0.0, 1.0]]
        ).double(),
    }
    golden["floor.routing.gate.scores"][1, 3] = 1.0 + 1e-4
    target = {"routing.gate.indices": torch.tensor([[1, 0], [2, 1], [0, 1]])}
    result = agreement("gate", golden, target, tie_tolerance=0.0)
    assert result.tokens == 3 and result.flipped == 2
    assert result.near_tie_tokens == (1,) and result.flipped_tokens == (1, 2)
    assert result.agreement == pytest.approx(1 / 3)
    assert "routing flipped on 1 near-tie tokens" in result.describe()
    assert "1 flipped without a near tie (a routing bug?)" in result.describe()


def test_noise_stats_separate_rounding_from_a_bias():
    from pytest_layerparity.compare.floor import floor_stats

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g, dtype=torch.float64)
    ref = x + 0.5 * torch.randn(64, 128, generator=g, dtype=torch.float64)
    golden = ref + 1e-3 * torch.randn(64, 128, generator=g, dtype=torch.float64)
    twin = ref + 1e-3 * torch.randn(64, 128, generator=g, dtype=torch.float64)
    scaled = x + (ref - x) * 1.002 + 1e-3 * torch.randn(64, 128, generator=g, dtype=torch.float64)
    same = floor_stats(golden, twin, ref, x)
    assert 0.9 < same.noise_ratio < 1.1 and abs(same.contribution_z) < 4
    bias = floor_stats(golden, scaled, ref, x)
    assert bias.noise_ratio < 1.5  # below the norm-based floor...
    assert abs(bias.contribution_z) > 6  # ...but a consistent error along the layer's contribution
