"""Decode-step parity: the layer's single-token path with its KV cache, on the embedded
default model's committed decode goldens (2 steps after the 32-token prompt)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from support import COUNT_CONTROLS, IDENTITY_PORT, TINY_REACH, cache_dropped

ROTARY_AT_ZERO_IN_DECODE = """
import torch

class RotaryAtZeroWhenDecoding(torch.nn.Module):
    # a port whose single-token path applies rotary at position 0 (cos 1, sin 0) in every step
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, *args, position_embeddings=None, **kwargs):
        if hidden_states.shape[-2] == 1 and position_embeddings is not None:
            cos, sin = position_embeddings
            position_embeddings = (torch.ones_like(cos), torch.zeros_like(sin))
        return self.layer(hidden_states, *args, position_embeddings=position_embeddings, **kwargs)

def pytest_layerparity_build_target_layer(layer_idx, reference_layer, model_config, device):
    if layer_idx == 3:
        return RotaryAtZeroWhenDecoding(reference_layer).to(device)
    return None
"""


def _properties(xml_path, name):
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        if case.get("name") == name:
            return {p.get("name"): p.get("value") for p in case.iter("property")}
    raise AssertionError(f"no test case {name}")


def test_xla_runs_the_layer_decode_and_whole_model_tests_and_they_pass(decode_project):
    result = decode_project.runpytest("--xla", "--junitxml=out.xml")
    result.assert_outcomes(passed=13)
    result.stdout.fnmatch_lines(["test_layer_decode_parity[[]layer_0[]] * pass *", "test_model_parity * pass *"])
    props = _properties(decode_project.path / "out.xml", "test_layer_decode_parity[layer_4]")
    assert props["decode_steps"] == "2" and props["failing_steps"] == "[]"
    assert float(props["new_keys_cosine"]) > 0.999 and float(props["new_values_noise_ratio"]) < 1.5
    assert float(props["noise_ratio"]) <= float(props["noise_ratio_limit"])
    props = _properties(decode_project.path / "out.xml", "test_model_parity")
    assert props["verdict"] == "pass" and props["positions"] == "34"  # 32 prompt tokens and 2 decode steps
    assert float(props["top1_agreement"]) >= 0.9 and props["greedy_flips_outside_ties"] == "0"
    assert 0 <= float(props["margin_drift"]) < 1 and float(props["near_tie_margin"]) >= 0
    assert 0 < float(props["kl_divergence"]) <= float(props["kl_divergence_limit"])
    low, high = float(props["logit_scale_low"]), float(props["logit_scale_high"])
    assert low < float(props["logit_scale"]) < high and low < 1 < high
    assert props["envelope_samples"] == "7"  # half a layer's 12 and one


def test_rotary_at_position_zero_when_decoding_fails_only_that_layers_decode_test(decode_project):
    decode_project.makeconftest(ROTARY_AT_ZERO_IN_DECODE)
    result = decode_project.runpytest("--target", "cpu")
    result.assert_outcomes(passed=12, failed=1)  # the prompt tests, the other layers' decode tests, the whole model
    result.stdout.fnmatch_lines(
        [
            "*_ test_layer_decode_parity?layer_3? _*",
            # its one token routed apart from the golden's on a near tie: the output is left out
            "layer 3 decode step 0 on cpu*: the keys and values it wrote to its KV cache differ from the golden's",
            "  shape (1, 1, 64), golden bfloat16, target bfloat16",
            "*new_keys_cosine * >= 0.99 * FAIL",
            "layer 3 decode step 1 on cpu*: output differs from the golden",
            "  control: the model's own layer on cpu*, on the same decode steps, passes: the difference is the port's",
            "FAILED layerparity::test_layer_decode_parity[[]layer_3[]] - *",
        ]
    )


def test_a_decode_step_leaving_a_ports_tighter_limits_runs_its_control_once_and_takes_its_reading(decode_project):
    """As a prompt test does (test_parity): each decode step of a port whose ratio leaves the
    tighter limits runs the model's own layer on that step once, and is held to 1.5 times its
    reading (a correct port, CONTROLLED_REACH made tiny: it passes, JUnit carries the reading)."""
    decode_project.makeconftest(IDENTITY_PORT + COUNT_CONTROLS + TINY_REACH)
    result = decode_project.runpytest("--target", "cpu", "--layers", "1", "-k", "decode", "--junitxml=out.xml")
    result.assert_outcomes(passed=1)
    props = _properties(decode_project.path / "out.xml", "test_layer_decode_parity[layer_1]")
    assert float(props["control_noise_ratio"]) == float(props["noise_ratio"])
    assert float(props["noise_ratio_limit"]) == 1.5 * float(props["noise_ratio"])
    assert (decode_project.path / "controls.txt").read_text().split() == ["1", "1"]  # one a step, two steps


def test_a_port_that_ignores_the_kv_cache_fails_its_decode_test(decode_project):
    """Its prompt writes nothing to the empty cache it is given: the prompt's keys and values
    are not judged there (a port may keep its cache elsewhere), its decode test fails."""
    decode_project.makeconftest(cache_dropped(1))
    result = decode_project.runpytest("--target", "cpu", "--layers", "1", "--junitxml=out.xml")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*new_keys_positions * 0 * == 1 * FAIL", "FAILED *test_layer_decode_parity[[]layer_1[]]*"]
    )
    props = _properties(decode_project.path / "out.xml", "test_layer_parity[layer_1]")
    assert props["prompt_kv"] == (
        "not judged: the layer wrote nothing to the empty cache it was given (it keeps its cache elsewhere, or none; "
        "its decode tests judge what it appends)"
    )


def test_a_layer_without_decode_goldens_says_how_to_extract_them(decode_project):
    manifest_path = decode_project.path / "goldens" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for step in (0, 1):
        del manifest["files"][f"layer_5.decode_{step}"]
    manifest_path.write_text(json.dumps(manifest))
    result = decode_project.runpytest("--target", "cpu", "--layers", "4-5")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(
        ["*no decode-step golden for layer_5; extract it with: pytest --gpu-golden --extract --model=* --layers 5*"]
    )


def test_a_prompt_only_store_adds_no_decode_tests(project):
    project.runpytest("--target", "cpu", "--layers", "0-1").assert_outcomes(passed=2)
