"""What a new user types wrong on first contact, and the one message each gets: a port from the
build hook that breaks the hook's contract (its call, its device, what it returns), no store
where the default folder is looked for, a layer range that is both reversed and too long."""

from __future__ import annotations

import pytest
from support import DEFAULT_MODEL, printed_before_summary

HOOKS = """
import torch

class Narrow(torch.nn.Module):  # a port written for another call
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, position_embeddings):
        return self.layer(hidden_states, position_embeddings=position_embeddings)


class WithWeights(torch.nn.Module):  # a port that returns what older layers returned
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, *args, **kwargs):
        return self.layer(hidden_states, *args, **kwargs), None


def pytest_layerparity_build_target_layer(layer_idx, reference_layer, model_config, device):
    if layer_idx in {layers}:
        return {port}
"""

HOOK_LINE = "def pytest_layerparity_build_target_layer(layer_idx, reference_layer, model_config, device):"
MISTAKES = {
    "call": (
        "Narrow(reference_layer).to(device)",
        "a Narrow that cannot take the golden call (got an unexpected keyword argument 'attention_mask'): its forward "
        "is Narrow.forward(hidden_states, position_embeddings), and the call passes 1 positional, attention_mask, "
        "cache, output_router_logits, position_embeddings, position_ids, use_cache; take the arguments the model's "
        "own MiniMaxM2DecoderLayer.forward(hidden_states, position_embeddings=None, attention_mask=None, "
        "position_ids=None, cache=None, **kwargs) takes (**kwargs for those the port does not use)",
    ),
    "device": (
        "reference_layer",
        "a MiniMaxM2DecoderLayer that holds self_attn.q_proj.weight on cpu where the test runs on xla:0; move it "
        "there in the hook (return the module .to(device), device being the hook's argument)",
    ),
    "output": (
        "WithWeights(reference_layer).to(device)",
        "a WithWeights that returns a tuple of 2 where the model's own MiniMaxM2DecoderLayer returns a tensor; "
        "return a tensor as it does: the model calls the layer in its own loop (test_model_parity) and takes what "
        "it returns as the next layer's input",
    ),
}


@pytest.mark.parametrize("kind", list(MISTAKES))
def test_a_broken_hook_is_named_once_and_no_test_of_its_layers_passes(decode_project, kind):
    port, what = MISTAKES[kind]
    conftest = decode_project.makeconftest(HOOKS.format(layers="range(6)", port=port))
    line = conftest.read_text().splitlines().index(HOOK_LINE) + 1
    result = decode_project.runpytest("--xla")
    result.assert_outcomes(failed=13)  # 6 prompt tests, 6 decode-step tests and the whole model
    result.stdout.fnmatch_lines(
        [
            "*_ test_layer_parity[[]layer_0[]] _*",
            f"pytest_layerparity_build_target_layer ({conftest}:{line}) returned for layer 0 {what}",
            "*_ test_layer_parity[[]layer_1[]] _*",
            "layer 1: the layer the build hook returned breaks the hook's contract as it does in "
            f"layerparity::test_layer_parity[[]layer_0[]] ({kind}): that test's failure says how, and the fix",
            "*_ test_model_parity _*",
            "layer 0: the layer the build hook returned breaks the hook's contract as it does in "
            f"layerparity::test_layer_parity[[]layer_0[]] ({kind}): that test's failure says how, and the fix",
        ]
    )
    text = result.stdout.str()
    assert printed_before_summary(result).count(what) == 1
    assert "Traceback" not in text and "Expected XLA tensor" not in text


def test_one_broken_layer_fails_its_tests_and_the_model_and_leaves_the_others_passing(decode_project):
    port, what = MISTAKES["output"]
    decode_project.makeconftest(HOOKS.format(layers="{4}", port=port))
    result = decode_project.runpytest("--target", "cpu", "-rA")
    result.assert_outcomes(passed=10, failed=3)
    failed = sorted(line.split(" - ")[0] for line in result.stdout.lines if line.startswith("FAILED "))
    assert failed == [
        "FAILED layerparity::test_layer_decode_parity[layer_4]",
        "FAILED layerparity::test_layer_parity[layer_4]",
        "FAILED layerparity::test_model_parity",
    ]
    result.stdout.fnmatch_lines(
        [
            "*_ test_model_parity _*",
            "layer 4: the layer the build hook returned breaks the hook's contract as it does in "
            "layerparity::test_layer_parity[[]layer_4[]] (output): that test's failure says how, and the fix",
        ]
    )
    assert printed_before_summary(result).count(what.replace("xla:0", "cpu")) == 1


def test_no_store_in_the_default_folder_is_one_error_naming_where_it_looked(pytester):
    pytester.mkdir("sub")
    sub = pytester.path / "sub"
    result = pytester.runpytest_subprocess("--target", "cpu", f"--model={DEFAULT_MODEL}", "--rootdir", str(sub))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert result.stderr.lines[0] == (
        f"ERROR: refusing the golden store: no golden store at {sub}/layerparity-goldens/minimax_m2_tiny (no "
        f"manifest.json) (the default: layerparity-goldens/minimax_m2_tiny under pytest's rootdir {sub}; give "
        f"--golden-dir or set layerparity_golden_dir for another); extract it with: pytest --gpu-golden --extract "
        f"--model={DEFAULT_MODEL} --golden-dir={sub}/layerparity-goldens/minimax_m2_tiny"
    )


def test_a_reversed_range_past_the_last_layer_is_one_error_whose_fix_runs(project):
    result = project.runpytest("--target", "cpu", "--layers", "7-2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: --layers '7-2': range 7-2 is reversed, and layer 7 is out of range; this model has 6 layers: "
            "valid layers are 0-5; write 2-5"
        ]
    )
    project.runpytest("--target", "cpu", "--layers", "2-5").assert_outcomes(passed=4)


def test_a_test_of_ones_own_drives_the_target_sides_steps(project):
    project.makepyfile(
        test_layer_2_by_hand="""
        def test_layer_2_by_hand(layerparity_session):
            target = layerparity_session.target
            entry = layerparity_session.load_golden(2)
            outcome = target.judge(2, entry, target.run(target.build(2), entry))
            assert outcome.passed and outcome.checks
        """
    )
    result = project.runpytest("--target", "cpu", "--layers", "2", "test_layer_2_by_hand.py")
    result.assert_outcomes(passed=2)  # the plugin's test of layer 2 and the file's own
