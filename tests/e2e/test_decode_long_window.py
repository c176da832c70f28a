"""A sliding window longer than the stored past (Gemma 3 270M's 512 under a 32-token prompt):
its decode steps replay on torch-xla, which refuses the slice transformers' entry takes from
``1 - window`` where eager torch clamps it, and a port that loses its cache still fails."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

import pytest
from support import ROOT, cache_dropped

sys.path.insert(0, str(ROOT / "fixtures"))  # tiny_models
from tiny_models import make


@pytest.fixture(scope="module")
def long_window_model(tmp_path_factory):
    return make("gemma3_long_window", tmp_path_factory.mktemp("gemma3") / "model")


@pytest.fixture
def long_window_project(pytester: pytest.Pytester, long_window_model) -> pytest.Pytester:
    pytester.makeini(f"[pytest]\nlayerparity_model = {long_window_model}\nlayerparity_golden_dir = goldens\n")
    pytester.runpytest("--gpu-golden", "--extract").assert_outcomes(passed=3)
    return pytester


def test_decode_steps_of_a_window_longer_than_the_past_pass_on_xla(long_window_project):
    from pytest_layerparity.store.golden import GoldenStore
    from pytest_layerparity.store.kv_updates import call_cache_node

    store = GoldenStore(long_window_project.path / "goldens")
    entry = store.load("layer_0.decode_0")
    node = call_cache_node(entry.metadata["call"])
    assert node["sliding_window"] == 512 and entry.tensors[node["keys"]].shape[-2] == 32
    prompt = store.load("layer_0")  # the prompt replayed with an empty sliding entry: its keys all held
    empty = {"layer": 0, "empty": True, "sliding_window": 512, "seen": 0}
    assert prompt.metadata["call"]["prompt_cache"]["cache"] == empty
    assert prompt.tensors["cache.new_keys"].shape[-2] == 32
    result = long_window_project.runpytest("--xla", "--junitxml=out.xml")
    result.assert_outcomes(passed=7)  # 3 prompts, 3 layers' decode steps, the whole model
    assert "Value out of range" not in result.stdout.str()
    result = long_window_project.runpytest("--target", "cpu", "-k", "test_layer_parity", "--junitxml=cpu.xml")
    result.assert_outcomes(passed=3)
    for xml in ("out.xml", "cpu.xml"):
        cases = ET.parse(long_window_project.path / xml).getroot().iter("testcase")
        prompts = [c for c in cases if c.get("name").startswith("test_layer_parity")]
        assert len(prompts) == 3
        for case in prompts:
            props = {p.get("name"): p.get("value") for p in case.iter("property")}
            assert props["prompt_kv"] == "judged" and float(props["prompt_keys_cosine"]) > 0.999
            assert float(props["prompt_keys_noise_ratio"]) <= float(props["prompt_keys_noise_ratio_limit"])


def test_a_sliding_layer_that_loses_its_cache_fails_its_decode_test_on_xla(long_window_project):
    long_window_project.makeconftest(cache_dropped(1))
    result = long_window_project.runpytest("--xla", "-rA")
    outcomes = {
        line.split()[1]: line.split()[0] for line in result.stdout.lines if line.startswith(("PASSED", "FAILED"))
    }
    assert outcomes.pop("layerparity::test_layer_decode_parity[layer_1]") == "FAILED"
    outcomes.pop("layerparity::test_model_parity")  # two decode positions of 34: the logits may or may not show it
    assert set(outcomes.values()) == {"PASSED"} and len(outcomes) == 5
