"""The prompt's KV cache judged: each layer's prompt call replayed with an empty cache, the keys
and values it wrote there held against those the reference's prompt left for the decode steps
(``store/promptkv.py``). A port whose prompt writes wrong keys fails its prompt test, though its
decode tests replay the golden's past and its output may pass."""

from __future__ import annotations

import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

from support import ROOT

PLANTED = f"""
import sys

import pytest

sys.path.insert(0, {str(ROOT / "fixtures")!r})
from planted_ports import {{port}}


@pytest.hookimpl
def pytest_layerparity_build_target_layer(layer_idx, reference_layer, model_config, device):
    return {{port}}(reference_layer{{more}}).to(device) if layer_idx == {{layer}} else None
"""
#: A port whose keys' rotary positions are rolled by one (token 0's key rotated as the last token's) at layer 2.
ROLLED_KEYS = PLANTED.format(port="RolledKeys", more="", layer=2)
#: A port that attends right and writes KV head 0's keys as head 1's (and 1's as 0's) at layer 4.
SWAPPED_KV_HEADS = PLANTED.format(port="SwappedKvHeads", more=", layer_idx", layer=4)


def _properties(xml_path):
    """Each test case's JUnit properties, by the case's name."""
    return {
        case.get("name"): {p.get("name"): p.get("value") for p in case.iter("property")}
        for case in ET.parse(xml_path).getroot().iter("testcase")
    }


def test_the_models_own_layers_pass_their_prompt_kv_checks_on_cpu(project):
    result = project.runpytest("--target", "cpu", "--junitxml=out.xml")
    result.assert_outcomes(passed=6)
    for name, props in _properties(project.path / "out.xml").items():
        assert props["prompt_kv"] == "judged", name
        assert float(props["prompt_keys_cosine"]) > 0.9999, name
        for part in ("keys", "values"):
            assert float(props[f"prompt_{part}_noise_ratio"]) <= float(props[f"prompt_{part}_noise_ratio_limit"])


def test_a_port_that_rolls_the_keys_rotary_positions_fails_its_prompt_test_on_the_keys(decode_project):
    """Token 0's key rotated as the last token's: the decode steps replay the golden's past and
    rotate one token, so only the prompt test can see it."""
    decode_project.makeconftest(ROLLED_KEYS)
    result = decode_project.runpytest("--target", "cpu", "--layers", "2-3", "--junitxml=out.xml")
    result.assert_outcomes(passed=3, failed=1)  # layer 3's prompt, both layers' decode steps
    result.stdout.fnmatch_lines(
        [
            "*_ test_layer_parity?layer_2? _*",
            "layer 2 on cpu*: output differs from the golden",
            "  shape (1, 32, 64), golden bfloat16, target bfloat16",
            "  prompt_keys_cosine * >= 0.99 * FAIL",
            "  prompt_keys_noise_ratio * <= * FAIL",
            "  prompt_values_cosine * 1 * >= 0.99 * ok",
            "  prompt_values_noise_ratio * <= * ok",
            "FAILED layerparity::test_layer_parity[[]layer_2[]] - *",
        ]
    )
    props = _properties(decode_project.path / "out.xml")["test_layer_parity[layer_2]"]
    assert float(props["prompt_keys_noise_ratio"]) > 10 * float(props["prompt_keys_noise_ratio_limit"])


def test_a_port_that_writes_one_kv_heads_keys_as_anothers_fails_its_prompt_test_on_xla(project):
    """Attention computed right, the cache written wrong: the output passes, the keys fail."""
    project.makeconftest(SWAPPED_KV_HEADS)
    result = project.runpytest("--xla", "--layers", "3-4", "--junitxml=out.xml")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*_ test_layer_parity?layer_4? _*",
            "layer 4 on xla:0*: the keys and values it wrote to its KV cache differ from the golden's",
            "  noise_ratio * <= * ok",
            "  prompt_keys_cosine * >= 0.99 * FAIL",
            "  prompt_keys_noise_ratio * <= 1.5 * FAIL",
            "  prompt_values_noise_ratio * <= 1.5 * ok",
            "FAILED layerparity::test_layer_parity[[]layer_4[]] - *",
        ]
    )
    props = _properties(project.path / "out.xml")
    assert props["test_layer_parity[layer_4]"]["prompt_kv"] == "judged"
    assert float(props["test_layer_parity[layer_4]"]["prompt_keys_cosine"]) < 0.5
    assert props["test_layer_parity[layer_3]"]["verdict"] == "pass"


def _as_before_prompt_kv(root: Path, model: Path) -> None:
    """Rewrite the store at ``root`` as one extracted before the prompt's keys and values were
    kept: each prompt golden without them and without the empty cache its replay took."""
    from pytest_layerparity.store.callspec import PROMPT_CACHE
    from pytest_layerparity.store.golden import GoldenStore

    store = GoldenStore(root, model)
    manifest = store.read_manifest()
    for key in [k for k in manifest["files"] if "." not in k and k.startswith("layer_")]:
        entry = store.load(key)
        tensors = {k: t for k, t in entry.tensors.items() if "cache.new_" not in k}
        metadata = dict(entry.metadata)
        metadata["call"] = {k: v for k, v in metadata["call"].items() if k != PROMPT_CACHE}
        store.write(key, tensors, metadata, record_extra={"weights_sha256": manifest["files"][key]["weights_sha256"]})


def test_an_old_store_without_prompt_kv_passes_and_says_they_were_not_judged(pytester):
    """NxDI's Llama goldens (fixtures/make_nxdi_fixtures.py) rewritten as extracted before the
    prompt's keys and values were kept: tested as before, and each prompt test says so."""
    shutil.copytree(ROOT / "fixtures" / "goldens" / "nxdi" / "llama-bfloat16", pytester.path / "goldens")
    model = ROOT / "fixtures" / "nxdi" / "llama"
    _as_before_prompt_kv(pytester.path / "goldens", model)
    pytester.makeini(f"[pytest]\nlayerparity_model = {model}\nlayerparity_golden_dir = goldens\n")
    result = pytester.runpytest("--target", "cpu", "-k", "test_layer_parity", "--junitxml=out.xml")
    result.assert_outcomes(passed=2)
    for props in _properties(pytester.path / "out.xml").values():
        assert props["prompt_kv"] == (
            "not judged: the golden holds no prompt keys and values (extracted before they were stored); re-extract "
            "to judge them"
        )
        assert not any(name.startswith("prompt_keys") for name in props)
