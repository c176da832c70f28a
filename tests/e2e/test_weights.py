"""Goldens bound to the weights they were extracted from: a run whose checkpoint holds other
weights (same config) is refused, naming the layer, both sources and the extraction that
binds the goldens to these weights, before a test of that layer can pass or blame the device."""

from __future__ import annotations

import json
import re

import pytest
from support import DEFAULT_MODEL, model_with_other_weights, printed_before_summary


def source(manifest_path):
    """The checkpoint the store's goldens were extracted from, as its manifest names it."""
    return json.loads(manifest_path.read_text())["model"]["path"]


def digests(manifest_path):
    files = json.loads(manifest_path.read_text())["files"]
    return {key: record.get("weights_sha256") for key, record in files.items() if re.fullmatch(r"layer_\d+", key)}


def test_the_committed_goldens_record_each_layers_weights():
    from support import DEFAULT_GOLDENS

    found = digests(DEFAULT_GOLDENS / "manifest.json")
    assert sorted(found) == [f"layer_{i}" for i in range(6)]
    assert all(re.fullmatch(r"[0-9a-f]{64}", d) for d in found.values())
    assert len(set(found.values())) == 6


def test_goldens_of_other_weights_are_refused_once_before_any_test(project):
    other = model_with_other_weights(project.path / "other", layers=list(range(6)))
    result = project.runpytest("--target", "cpu", f"--model={other}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    manifest = project.path / "goldens" / "manifest.json"
    recorded = digests(manifest)["layer_0"]
    result.stderr.fnmatch_lines(
        [
            f"ERROR: refusing the golden store: {project.path}/goldens/manifest.json: layer 0's weights in {other} "
            f"(sha256 *) are not the weights its goldens were extracted from ({source(manifest)}: sha256 "
            f"{recorded[:12]}), so its tests would judge another model's layer; extract the goldens again from "
            f"these weights: pytest --gpu-golden --extract --model={other} --golden-dir={project.path}/goldens "
            "--decode-steps 0 --force-regen"
        ]
    )
    assert "passed" not in result.stdout.str()


def test_a_layer_of_other_weights_errors_alone_and_the_model_test_with_it(decode_project):
    other = model_with_other_weights(decode_project.path / "other", layers=[3])
    extracted_from = source(decode_project.path / "goldens" / "manifest.json")
    result = decode_project.runpytest("--target", "cpu", f"--model={other}", "-rA")
    # layer 3's prompt test errors at set-up (its golden is refused), its decode test and the whole model fail
    result.assert_outcomes(passed=10, failed=2, errors=1)
    message = (
        f"*manifest.json: layer 3's weights in {other} (sha256 *) are not the weights its goldens were extracted "
        f"from ({extracted_from}: sha256 *), so its tests would judge another model's layer; extract the goldens "
        f"again from these weights: pytest --gpu-golden --extract --model={other} --golden-dir=* --force-regen"
    )
    result.stdout.fnmatch_lines([message])
    text = result.stdout.str()
    assert printed_before_summary(result).count("layer 3's weights in") == 3  # once per test of it
    assert "kernels or its compiler" not in text  # no device diagnosis of a layer whose goldens are another's


def test_force_regen_binds_the_store_to_the_new_weights(project):
    other = model_with_other_weights(project.path / "other", layers=[0])
    extract = ("--gpu-golden", "--extract", f"--model={other}", "--decode-steps", "0", "--envelope-samples", "0")
    refused = project.runpytest(*extract)
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    extracted_from = source(project.path / "goldens" / "manifest.json")
    refused.stderr.fnmatch_lines(
        [
            "*this store holds goldens of another extraction (*layer 0's weights: store has sha256 * (from "
            f"{extracted_from}), this run has * (in {other})); extract into another --golden-dir, or add "
            "--force-regen to replace the store*"
        ]
    )
    before = digests(project.path / "goldens" / "manifest.json")
    project.runpytest(*extract, "--force-regen").assert_outcomes(passed=6)
    after = digests(project.path / "goldens" / "manifest.json")
    assert after["layer_0"] != before["layer_0"]
    assert {k: v for k, v in after.items() if k != "layer_0"} == {k: v for k, v in before.items() if k != "layer_0"}
    project.runpytest("--target", "cpu", f"--model={other}").assert_outcomes(passed=6)


def test_a_store_without_digests_is_tested_and_says_it_is_not_bound(project):
    manifest_path = project.path / "goldens" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for record in manifest["files"].values():
        record.pop("weights_sha256", None)
    manifest_path.write_text(json.dumps(manifest))
    result = project.runpytest("--target", "cpu", "--layers", "0-1")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "layerparity: weights: not checked for layers 0-1: the store records no digest of the weights they were "
            "extracted from (an older extraction); extract again to bind them: pytest --gpu-golden --extract "
            f"--model={DEFAULT_MODEL} --golden-dir=*/goldens --decode-steps 0 --force-regen"
        ]
    )
