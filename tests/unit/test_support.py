from __future__ import annotations

from types import SimpleNamespace

import pytest

from pytest_layerparity.reference.model import ModelError
from pytest_layerparity.reference.support import check_decode_cache


def _model(model_type: str, **fields):
    from transformers import AutoConfig

    return SimpleNamespace(hf_config=AutoConfig.for_model(model_type, **fields))


def test_decode_steps_of_a_linear_attention_layer_are_refused_up_front_naming_the_fix():
    model = _model("qwen3_next", num_hidden_layers=4)  # three linear-attention layers, then a full one
    with pytest.raises(ModelError) as excinfo:
        check_decode_cache(model, [1, 3], decode_steps=2)
    assert str(excinfo.value) == (
        "--decode-steps 2: layer 1's KV-cache entry is a LinearAttentionLayer: it holds state beyond keys and "
        "values, which a decode-step golden cannot store; extract with --decode-steps 0 (the prompt tests and the "
        "whole model's prompt still run)"
    )
    check_decode_cache(model, [3], decode_steps=2)  # the full-attention layer alone
    check_decode_cache(model, [0, 1, 2, 3], decode_steps=0)  # no decode steps asked for


def test_sliding_window_and_full_attention_layers_are_taken():
    check_decode_cache(_model("gemma2", num_hidden_layers=3), [0, 1, 2], decode_steps=2)
    check_decode_cache(_model("llama", num_hidden_layers=2), [0, 1], decode_steps=2)


def test_a_cache_entry_the_modeling_module_defines_is_refused_up_front():
    """DeepSeek-V4's compressed-attention entries register themselves when its modeling module
    is imported: the check imports it first (in a fresh process, where nothing else has)."""
    import subprocess
    import sys

    code = (
        "from types import SimpleNamespace\n"
        "from transformers import AutoConfig\n"
        "from pytest_layerparity.reference.support import check_decode_cache\n"
        "config = AutoConfig.for_model('deepseek_v4', num_hidden_layers=3)\n"
        "try:\n"
        "    check_decode_cache(SimpleNamespace(hf_config=config), [0], decode_steps=2)\n"
        "except Exception as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "layer 0's KV-cache entry is a DeepseekV4HCACache: it holds state beyond keys and values" in done.stdout
