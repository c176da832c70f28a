"""Each test says what it could see: its detection limits (the smallest attention-output,
MLP-output and attention-score scale and norm-epsilon factor it fails on) in the summary's pass
line, the failure text and JUnit, and a change of twice the stated size fails where one of
half passes."""

from __future__ import annotations

import csv
import xml.etree.ElementTree as ET

import pytest
from support import DEFAULT_MODEL

SCALED_ATTENTION = """
import pytest

@pytest.hookimpl
def pytest_layerparity_build_target_layer(layer_idx, reference_layer, model_config, device):
    if layer_idx == 2:
        def scaled(module, args, out):
            return (out[0] * {factor}, *out[1:])
        reference_layer.self_attn.register_forward_hook(scaled)
    return None
"""


def _properties(xml_path):
    return {
        case.get("name"): {p.get("name"): p.get("value") for p in case.iter("property")}
        for case in ET.parse(xml_path).getroot().iter("testcase")
    }


@pytest.fixture
def extracted(pytester):
    """Goldens of layer 2 of the default model, extracted now."""
    pytester.makeini(
        f"[pytest]\nlayerparity_model = {DEFAULT_MODEL}\nlayerparity_golden_dir = store\n"
        "layerparity_decode_steps = 0\nlayerparity_logits_topk = 0\n"
    )
    pytester.runpytest("--gpu-golden", "--extract", "--layers", "2").assert_outcomes(passed=1)
    return pytester


def test_a_pass_states_what_it_could_see_and_the_limit_holds_both_ways(extracted):
    result = extracted.runpytest("--target", "cpu", "--layers", "2", "--junitxml=out.xml", "--parity-report", "report")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "test_layer_parity[[]layer_2[]] * pass *",
            "  sees attention output +-*%, MLP output +-*%, attention scores' scale +-*% (beyond the port's own "
            "error); out of sight: norm epsilon below x100 (bfloat16; float32 goldens, --dtype float32, round 2^16 "
            "times finer)",
        ]
    )
    props = _properties(extracted.path / "out.xml")["test_layer_parity[layer_2]"]
    for kind in ("attention_scale", "mlp_scale", "temperature"):
        assert 0 < float(props[f"detection_{kind}"]) < 0.1, kind
    assert float(props["detection_norm_epsilon"]) > 100  # bfloat16 cannot see an epsilon read 100 times too large
    assert props["detection_text"].startswith("sees attention output +-")
    with open(extracted.path / "report" / "report.csv", newline="") as handle:
        row = next(csv.DictReader(handle))
    assert float(row["detection_attention_scale"]) == pytest.approx(float(props["detection_attention_scale"]))
    assert "detection_attention_scale" in (extracted.path / "report" / "report.html").read_text()
    limit = float(props["detection_attention_scale"])
    for factor, fails in ((1 + limit / 2, False), (1 - limit / 2, False), (1 + 2 * limit, True), (1 - 2 * limit, True)):
        extracted.makeconftest(SCALED_ATTENTION.format(factor=factor))
        run = extracted.runpytest("--target", "cpu", "--layers", "2")
        run.assert_outcomes(**({"failed": 1} if fails else {"passed": 1}))
        if fails:
            line = "  detection: sees attention output +-*% (in a port that rounds as the reference did)*"
            run.stdout.fnmatch_lines([line])
