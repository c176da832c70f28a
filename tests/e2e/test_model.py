"""Whole-model parity: the embedded default model's next-token distributions, prompt and
teacher-forced decode steps, against the committed compact logits golden (the passing run on
torch-xla is in test_decode.py, with the decode-step tests)."""

from __future__ import annotations

import pytest

PLANTED = """
import torch
from transformers import AutoModelForCausalLM

from pytest_layerparity.model.steps import hf_step

def pytest_layerparity_build_target_model(model_config, device, settings):
    model = AutoModelForCausalLM.from_pretrained(settings.model, dtype=torch.bfloat16)
    with torch.no_grad():
        {plant}
    return hf_step(model.eval().to(device))
"""
#: The final norm's weight off by 20%. The embedded model's routers have near-ties that some of
#: the whole model's perturbed runs flip, which moves their logits and widens the range of
#: logit_scale (the committed envelope's: 0.97-1.03, 7 runs).
FINAL_NORM = "model.model.norm.weight.mul_(0.8)  # the final norm's weight off by 20%"
LM_HEAD = "model.lm_head.weight.copy_(model.lm_head.weight.roll(1, dims=0))  # vocabulary rows shifted by one"


@pytest.mark.parametrize("plant", [FINAL_NORM, LM_HEAD], ids=["final-norm", "lm-head"])
def test_a_bug_after_the_last_layer_fails_the_whole_model_test_and_no_layer_test(decode_project, plant):
    decode_project.makeconftest(PLANTED.format(plant=plant))
    result = decode_project.runpytest("--target", "cpu")
    result.assert_outcomes(passed=12, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*_ test_model_parity _*",
            "whole model on cpu*: next-token distributions differ from the golden's (34 positions)",
            "*FAIL",
            "  top-1 agreement *, top-k overlap *, KL median *",
            "*noise envelope from 7 perturbed reference runs of the whole model: they reach median KL *",
            "  control: the model's own transformers model on cpu*, on the same tokens, passes: the difference is the "
            "port's",
            "FAILED layerparity::test_model_parity - *",
        ]
    )


def test_the_whole_model_test_is_left_out_when_layers_are_narrowed(decode_project):
    result = decode_project.runpytest("--target", "cpu", "--layers", "0")
    result.assert_outcomes(passed=2)
