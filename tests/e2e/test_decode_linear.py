"""Decode steps of linear-attention layers: a tiny Qwen3-Next (gated delta-rule layers 0 and 2,
full attention between them) made here, extracted with its decode steps, whose goldens hold
each linear layer's convolution and recurrent states as the step found them and as it left
them."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

import pytest
from support import ROOT, cache_dropped


@pytest.fixture(scope="module")
def linear_model(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "fixtures"))
    try:
        from any_model import make
    finally:
        sys.path.remove(str(ROOT / "fixtures"))
    return make("qwen3_next", tmp_path_factory.mktemp("qwen3_next") / "model")


@pytest.fixture
def linear_project(pytester: pytest.Pytester, linear_model) -> pytest.Pytester:
    pytester.makeini(f"[pytest]\nlayerparity_model = {linear_model}\nlayerparity_golden_dir = goldens\n")
    pytester.runpytest("--gpu-golden", "--extract").assert_outcomes(passed=3)
    return pytester


def test_linear_attention_layers_are_extracted_with_their_states_and_their_decode_steps_pass(linear_project):
    from pytest_layerparity.store.golden import GoldenStore
    from pytest_layerparity.store.kv_updates import call_cache_node

    entry = GoldenStore(linear_project.path / "goldens").load("layer_2.decode_0")
    linear = call_cache_node(entry.metadata["call"])["linear"]
    assert linear["kind"].startswith("LinearAttention") and linear["previous"] == [0]
    assert {part: len(linear[part]) for part in ("conv", "recurrent")} == {"conv": 1, "recurrent": 1}
    result = linear_project.runpytest("--xla", "--junitxml=out.xml")
    result.assert_outcomes(passed=7)  # 3 prompts, 3 layers' decode steps (2 each), the whole model
    result.stdout.fnmatch_lines(["test_layer_decode_parity[[]layer_2[]] * pass *"])
    cases = ET.parse(linear_project.path / "out.xml").getroot().iter("testcase")
    props = next(
        {p.get("name"): p.get("value") for p in c.iter("property")}
        for c in cases
        if "layer_2" in c.get("name") and "decode" in c.get("name")
    )
    assert float(props["new_recurrent_states_cosine"]) > 0.9999  # the states the step left, judged
    assert float(props["new_recurrent_states_noise_ratio"]) > 0 and "new_keys_cosine" not in props
    for layer in range(3):  # the prompt's cache: not known to leave a linear layer's output as it is
        props = next(
            {p.get("name"): p.get("value") for p in c.iter("property")}
            for c in ET.parse(linear_project.path / "out.xml").getroot().iter("testcase")
            if c.get("name") == f"test_layer_parity[layer_{layer}]"
        )
        assert props["prompt_kv"] == (
            "not judged: its layers are not all attention layers (linear_attention): a cache entry that holds other "
            "state is not known to leave a layer's output as it is without a cache"
        )


def test_a_port_that_loses_the_states_between_steps_fails_that_layers_decode_test(linear_project):
    linear_project.makeconftest(cache_dropped(2))
    result = linear_project.runpytest("--target", "cpu")
    result.assert_outcomes(passed=5, failed=2)  # the prompts and the other layers' decode tests pass
    result.stdout.fnmatch_lines(["*_ test_layer_decode_parity?layer_2? _*", "*_ test_model_parity _*"])
    result.stdout.fnmatch_lines(["test_layer_decode_parity[[]layer_0[]] * pass *"])
