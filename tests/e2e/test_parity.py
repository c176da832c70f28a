"""`pytest --xla` / `--target cpu` against the committed goldens of the default model."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from support import COUNT_CONTROLS, IDENTITY_PORT, TINY_REACH

PLANT_EPSILON = """
import pytest

@pytest.hookimpl
def pytest_layerparity_build_target_layer(layer_idx, reference_layer, model_config, device):
    if layer_idx == 3:
        # the bug: a wrong RMSNorm epsilon in one layer of the port
        reference_layer.input_layernorm.variance_epsilon = 0.5
    return None  # fall through to the default build
"""

SWAP_ROTARY = """
import pytest, torch

class SwappedRotary(torch.nn.Module):
    '''Wraps a layer and swaps the rotary halves (cos <-> sin) it is given.'''
    def __init__(self, layer):
        super().__init__()
        self.layer = layer
    def forward(self, hidden_states, position_embeddings=None, **kwargs):
        cos, sin = position_embeddings
        return self.layer(hidden_states, position_embeddings=(sin, cos), **kwargs)

@pytest.hookimpl
def pytest_layerparity_build_target_layer(layer_idx, reference_layer, model_config, device):
    layer = reference_layer.to(device)
    return SwappedRotary(layer) if layer_idx == 1 else layer
"""


def test_xla_parity_passes_every_layer_of_the_default_model(project):
    result = project.runpytest("--xla", "-v", "--junitxml=out.xml")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines(
        [
            "layerparity: target xla, dtype bfloat16",
            "layerparity: verdict: noise policy (bfloat16): fail on NaN/Inf, cosine_similarity < 0.99, or noise_ratio, "
            "token_noise_ratio or contribution_bias * outside the layer's noise envelope at false-alarm rate 0.001 *",
            *[f"*test_layer_parity?layer_{i}? PASSED*" for i in range(6)],
            "*layerparity summary*",
        ]
    )
    tree = ET.parse(project.path / "out.xml")
    cases = tree.findall(".//testcase")
    assert len(cases) == 6
    for case in cases:
        props = {p.get("name"): p.get("value") for p in case.findall("./properties/property")}
        for name in (
            "max_abs_diff",
            "mean_abs_diff",
            "similarity_percentage",
            "cosine_similarity",
            "pearson_correlation",
            "has_nan",
            "has_inf",
            "layers",
            "verdict",
            "noise_ratio",
            "token_noise_ratio",
            "contribution_bias",
            "routing_agreement",
            "noise_ratio_limit",
            "contribution_bias_low",
            "contribution_bias_high",
        ):
            assert name in props, (case.get("name"), name)
        assert props["verdict"] == "pass"
        assert float(props["noise_ratio"]) <= float(props["noise_ratio_limit"])
        assert float(props["contribution_bias_low"]) <= float(props["contribution_bias"])
        assert float(props["contribution_bias"]) <= float(props["contribution_bias_high"])
        assert props["envelope_samples"] == "12"
        assert float(props["routing_agreement"]) > 0.9  # bf16 flips a near-tie token in some layers
        assert props["prompt_kv"] == "judged"  # the keys and values the prompt wrote to an empty cache
        for part in ("keys", "values"):
            assert float(props[f"prompt_{part}_noise_ratio"]) <= float(props[f"prompt_{part}_noise_ratio_limit"])


def test_planted_bug_fails_exactly_that_layer_on_xla(project):
    project.makeconftest(PLANT_EPSILON)
    result = project.runpytest("--xla", "--layers", "2-4")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*_ test_layer_parity?layer_3? _*",
            "layer 3 on xla:0*: output differs from the golden",
            "  shape (1, 32, 64), golden bfloat16, target bfloat16",
            "  noise_ratio * <= * FAIL",
            "  token_noise_ratio * <= * FAIL",
            "  contribution_bias * in [[]*, *[]] * FAIL",
            "  worst element: index (0, *, *): golden *, target *",
            "  precision floor: ||golden - ref|| = *, ||target - ref|| = *; worst token * at *x its floor*",
            "  noise envelope from 12 perturbed runs of this layer: they reach noise_ratio *; limits at t=*",
            "  routing (mlp.gate): *",
            "  minimum passing tolerance: atol * (with rtol 0); rtol * (with atol 0); -o layerparity_max_noise_ratio=*",
            "  drill in: pytest --xla --model=* --golden-dir=* --layers 3 -k layer_3 --op-compare -vv",
            "FAILED layerparity::test_layer_parity[[]layer_3[]] - *",
        ]
    )


def test_a_failing_port_is_held_beside_the_models_own_layer_on_the_same_device(project):
    """The port's failure says whether the model's own layer passes on the same device and
    call (the hook changed the layer: it does) or fails too (limits
    set tighter than the device's arithmetic: the port is the model's layer, unchanged);
    JUnit carries control_passed. Without a hook there is nothing to hold the layer beside: the
    failure says the difference is the device's."""
    project.makeconftest(PLANT_EPSILON)
    result = project.runpytest("--target", "cpu", "--layers", "3", "--junitxml=out.xml")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*_ test_layer_parity?layer_3? _*",
            "  control: the model's own layer on cpu*, on the same call, passes: the difference is the port's",
        ]
    )
    root = ET.parse(project.path / "out.xml").getroot()
    assert [p.get("value") for p in root.iter("property") if p.get("name") == "control_passed"] == ["True"]
    tight = ["--target", "cpu", "--layers", "2", "-k", "test_layer_parity", "-o", "layerparity_max_noise_ratio=0.1"]
    result = project.runpytest(*tight)  # layer 2 through the hook unchanged
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["  control: the model's own layer on cpu*, on the same call, fails too (noise_ratio *): the device's *"]
    )
    project.makeconftest("")
    result = project.runpytest(*tight)
    result.assert_outcomes(failed=1)
    assert "control:" not in result.stdout.str()
    result.stdout.fnmatch_lines(
        ["  the layer under test is the model's own transformers layer (no port): what differs is how this device *"]
    )


def _properties(path, test):
    root = ET.parse(path).getroot()
    case = next(c for c in root.iter("testcase") if c.get("name") == test)
    return {p.get("name"): p.get("value") for p in case.iter("property")}


def test_a_port_is_held_to_tighter_limits_which_its_same_device_controls_reading_widens(project):
    """A port's ratio limits are at most CONTROLLED_REACH times its runs' largest (JUnit
    ``controllable``), tighter than the model's own layer's; where a port leaves them (here a
    correct port, CONTROLLED_REACH made tiny), the model's own layer runs once on the same call
    and the limits take 1.5 times its reading: the port passes, JUnit carries the control's
    reading. A failing port's control line reuses that run."""
    test = "test_layer_parity[layer_2]"
    project.runpytest("--target", "cpu", "--layers", "2", "--junitxml=own.xml").assert_outcomes(passed=1)
    own = _properties(project.path / "own.xml", test)
    assert "controllable" not in own
    project.makeconftest(IDENTITY_PORT + COUNT_CONTROLS)
    project.runpytest("--target", "cpu", "--layers", "2", "--junitxml=port.xml").assert_outcomes(passed=1)
    port = _properties(project.path / "port.xml", test)
    assert port["controllable"] == "True" and "control_noise_ratio" not in port
    assert float(port["noise_ratio_limit"]) <= float(own["noise_ratio_limit"])
    assert not (project.path / "controls.txt").exists()  # within the tighter limits: no control ran
    project.makeconftest(IDENTITY_PORT + COUNT_CONTROLS + TINY_REACH)
    project.runpytest("--target", "cpu", "--layers", "2", "--junitxml=tiny.xml").assert_outcomes(passed=1)
    read = _properties(project.path / "tiny.xml", test)
    assert float(read["control_noise_ratio"]) == pytest.approx(float(read["noise_ratio"]))
    assert float(read["noise_ratio_limit"]) == pytest.approx(1.5 * float(read["noise_ratio"]))
    assert (project.path / "controls.txt").read_text().split() == ["2"]
    (project.path / "controls.txt").unlink()
    project.makeconftest(PLANT_EPSILON + COUNT_CONTROLS)
    result = project.runpytest("--target", "cpu", "--layers", "3")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["  control: the model's own layer on cpu*, on the same call, passes: *"])
    assert (project.path / "controls.txt").read_text().split() == ["3"]  # once: the limits', the line's


def test_a_control_that_cannot_run_on_the_device_says_so_and_the_port_still_fails(project):
    """A stand-in for a device the model's own layer does not run on (its build raises)."""
    project.makeconftest(
        PLANT_EPSILON
        + """
from pytest_layerparity.replay.runner import TargetSide

@pytest.fixture(autouse=True)
def no_own_layer_on_the_device(monkeypatch):  # undone after each test: pytester runs in this process
    own = TargetSide.own_layer

    def no_own_layer(self, index, on_device=True):
        if on_device:
            raise RuntimeError("an op this device does not have")
        return own(self, index, on_device)

    monkeypatch.setattr(TargetSide, "own_layer", no_own_layer)
"""
    )
    result = project.runpytest("--target", "cpu", "--layers", "3", "--junitxml=out.xml")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["  control: the model's own layer could not run on cpu*: RuntimeError: an op this device does not have"]
    )
    root = ET.parse(project.path / "out.xml").getroot()
    assert not [p for p in root.iter("property") if p.get("name") == "control_passed"]


def test_swapped_rotary_halves_fail_that_layer(project):
    project.makeconftest(SWAP_ROTARY)
    result = project.runpytest("--target", "cpu")
    result.assert_outcomes(passed=5, failed=1)
    result.stdout.fnmatch_lines(["FAILED layerparity::test_layer_parity[[]layer_1[]]*"])


def test_k_selects_one_layer_and_lf_reruns_failures(project):
    result = project.runpytest("--target", "cpu", "-k", "layer_2", "-v")
    result.assert_outcomes(passed=1, deselected=5)
    result.stdout.fnmatch_lines(["*test_layer_parity?layer_2? PASSED*"])
    project.makeconftest(PLANT_EPSILON)
    project.runpytest("--target", "cpu").assert_outcomes(passed=5, failed=1)
    result = project.runpytest("--target", "cpu", "--lf")
    result.assert_outcomes(failed=1, deselected=5)


def test_goldens_load_lazily(project):
    """A test reads only its own layer's golden: the others may be corrupt."""
    for i in (0, 1, 3, 4, 5):
        path = project.path / "goldens" / f"layer_{i:05d}.safetensors"
        path.write_bytes(b"garbage")
    result = project.runpytest("--target", "cpu", "-k", "layer_2")
    result.assert_outcomes(passed=1, deselected=5)


def test_corrupt_golden_errors_naming_the_file(project):
    path = project.path / "goldens" / "layer_00004.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    result = project.runpytest("--target", "cpu")
    result.assert_outcomes(passed=5, errors=1)
    result.stdout.fnmatch_lines(
        [
            f"*{path}: sha256 * does not match the manifest's *regenerate it with: pytest --gpu-golden --extract "
            "--model=* --golden-dir=*"
        ]
    )


def test_missing_golden_errors_with_the_extraction_command(project):
    manifest_path = project.path / "goldens" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["files"]["layer_5"]
    manifest_path.write_text(json.dumps(manifest))
    result = project.runpytest("--target", "cpu", "--layers", "5")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["*no golden for layer_5; extract it with: pytest --gpu-golden --extract --model=* --golden-dir=* --layers 5*"]
    )
    text = result.stdout.str()
    assert "During handling" not in text
    # printed once; pytest's short summary repeats it (in full when CI is set, cut to the width otherwise)
    report = text.split("short test summary info")[0]
    assert report.count("no golden for layer_5; extract it with") == 1


def test_store_of_another_model_is_refused_before_any_layer_runs(project):
    manifest_path = project.path / "goldens" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["model"]["hidden_size"] = 4096
    manifest_path.write_text(json.dumps(manifest))
    result = project.runpytest("--target", "cpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*refusing the golden store: *manifest.json: the goldens were made from another model or setting than * "
            "(model.hidden_size: store has 4096, this run has 64); extract them again for this model: pytest "
            "--gpu-golden --extract*"
        ]
    )


def test_layer_ranges_run_end_to_end_and_name_the_first_bad_layer(project):
    project.makeconftest(PLANT_EPSILON)
    result = project.runpytest("--target", "cpu", "--layers", "0", "--layer-ranges", "0-1,2-5")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*range 2-5: * of 4 layers leave tolerance; the first is layer 3",
            "FAILED layerparity::test_layer_range_parity[[]layers_2-5[]]*",
        ]
    )


def test_parity_report_json(project):
    project.makeconftest(PLANT_EPSILON)
    result = project.runpytest("--target", "cpu", "--layers", "2-3", "--parity-report", "rep")
    result.assert_outcomes(passed=1, failed=1)
    report = json.loads((project.path / "rep" / "report.json").read_text())
    by_id = {t["nodeid"]: t for t in report["tests"]}
    assert set(by_id) == {"layerparity::test_layer_parity[layer_2]", "layerparity::test_layer_parity[layer_3]"}
    bad = by_id["layerparity::test_layer_parity[layer_3]"]
    assert bad["verdict"] == "fail" and bad["layers"] == "3"
    assert set(bad["metrics"]) >= {
        "max_abs_diff",
        "mean_abs_diff",
        "similarity_percentage",
        "cosine_similarity",
        "pearson_correlation",
    }
    assert by_id["layerparity::test_layer_parity[layer_2]"]["verdict"] == "pass"
    result.stdout.fnmatch_lines(["first failing: test_layer_parity[[]layer_3[]] (layers 3)"])


@pytest.mark.parametrize("workers", [None, "2"])
def test_parity_with_and_without_xdist(project, workers):
    project.makeconftest(PLANT_EPSILON)
    args = ["--target", "cpu", "--parity-report", "rep"]
    if workers:
        args += ["-n", workers]
    else:
        args += ["-p", "no:xdist"]
    result = project.runpytest_subprocess(*args)
    result.assert_outcomes(passed=5, failed=1)
    report = json.loads((project.path / "rep" / "report.json").read_text())
    assert len(report["tests"]) == 6


WRONG_XLA_RSQRT = """
import warnings
import torch
import torch_xla  # registers the real XLA kernels first; ours then replaces rsqrt's

_lib = torch.library.Library("aten", "IMPL")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    # the bug: a wrong rsqrt kernel on the device (5% too large), as a broken backend kernel would be
    _lib.impl("rsqrt", lambda x: torch.ops.aten.pow.Tensor_Scalar(x, -0.5) * 1.05, "XLA")
"""


def test_op_compare_names_the_first_wrong_op_and_how_to_replay_it(project):
    project.makeconftest(WRONG_XLA_RSQRT)
    result = project.runpytest_subprocess(
        "--xla", "--layers", "1", "--op-compare", "-o", "layerparity_op_compare_dir=ops"
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "  op-compare (the layer re-run op by op against the CPU):",
            "    first op that fails: MiniMaxM2DecoderLayer/MiniMaxM2RMSNorm/torch.ops.aten.rsqrt(forward): * "
            "elements off *",
            "    replay: python -c *compare_for_single_op(*torch.ops.aten.rsqrt_inputs.safetensors*",
        ]
    )
    dump = next((project.path / "ops" / "layer_1").glob("torch.ops.aten.rsqrt_inputs.safetensors"))
    from pytest_layerparity.ops import compare_for_single_op

    correct, _args, _kwargs, _out = compare_for_single_op(str(dump), "torch.ops.aten.rsqrt", atol=1e-4, rtol=1e-4)
    assert correct  # without the wrong kernel (this process), the op itself is fine: the kernel was the bug


def test_own_tests_can_use_the_op_fixtures(pytester):
    pytester.makepyfile(
        """
        import torch

        def test_nan(nan_inf_tracker):
            lin = torch.nn.Linear(4, 4)
            with nan_inf_tracker() as tracker:
                torch.log(lin(torch.ones(2, 4)) - 100.0)
            assert tracker.first_failure is not None
            assert tracker.first_failure.op_name == "torch.ops.aten.log"

        def test_compare(compare_with_cpu):
            with compare_with_cpu(atol=1e-5, rtol=1e-5) as tool:
                torch.ones(3) * 2
            assert tool.failures == []
        """
    )
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_batched_experts_on_xla_pass_every_layer(project):
    result = project.runpytest("--xla", "-o", "layerparity_experts_implementation=batched_mm")
    result.assert_outcomes(passed=6)
