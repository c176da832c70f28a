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


def _checkpoint(folder, model_type: str, keys: list[str]):
    import json

    import torch
    from safetensors.torch import save_file

    from pytest_layerparity.reference.model import Checkpoint

    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["LlamaForCausalLM"]}))
    save_file({k: torch.zeros(2) for k in keys}, str(folder / "model.safetensors"))
    return Checkpoint.open(folder)


def test_a_layer_is_found_under_the_names_transformers_renames_as_it_loads(tmp_path, monkeypatch):
    """A checkpoint whose layers are named transformer.h.N, for a model type whose conversion
    mapping renames them to model.layers.N as it loads: a layer's tensors are found under the
    checkpoint's names, through the installed transformers' own WeightRenaming."""
    from transformers import conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    own = conversion_mapping.get_checkpoint_conversion_mapping
    renames = {
        "renamed": [WeightRenaming(r"^transformer\.h\.", "model.layers."), WeightRenaming(r"c_fc_0", "gate_proj")]
    }
    monkeypatch.setattr(conversion_mapping, "get_checkpoint_conversion_mapping", lambda t: renames.get(t) or own(t))
    keys = ["transformer.h.0.ln_1.weight", "transformer.h.0.mlp.c_fc_0.weight", "transformer.h.1.ln_1.weight"]
    checkpoint = _checkpoint(tmp_path / "renamed", "renamed", keys)
    assert checkpoint.layer_keys("model.layers", 0) == keys[:2]
    assert checkpoint.model_name(keys[1]) == "model.layers.0.mlp.gate_proj.weight"
    assert _checkpoint(tmp_path / "llama", "llama", keys).layer_keys("model.layers", 0) == []  # llama renames none


def test_exaone_checkpoints_layers_are_found_under_its_own_names(tmp_path):
    """EXAONE's checkpoints name layers transformer.h.N; transformers (from the release that
    brought EXAONE) renames them to model.layers.N as it loads."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "exaone" not in CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no EXAONE (it came after the oldest supported release)")
    keys = ["transformer.h.0.ln_1.weight", "transformer.h.0.mlp.c_fc_0.weight", "transformer.h.1.ln_1.weight"]
    checkpoint = _checkpoint(tmp_path / "exaone", "exaone", keys)
    assert checkpoint.layer_keys("model.layers", 0) == keys[:2]
    assert checkpoint.model_name(keys[1]) == "model.layers.0.mlp.gate_proj.weight"


def test_a_layers_tensors_kept_outside_it_are_found_under_the_names_transformers_gives_them(tmp_path, monkeypatch):
    """Inkling-2's checkpoints keep each layer's MLP input query outside the layer
    (model.llm.attn_res.mlp_queries.N, which transformers renames to model.layers.N.mlp_input.query
    as it loads): a layer's keys are those whose names under the model's names are the
    layer's, wherever the checkpoint keeps them."""
    from transformers import conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    own = conversion_mapping.get_checkpoint_conversion_mapping
    renames = {
        "kept_outside": [
            WeightRenaming(r"^model\.llm\.", "model."),
            WeightRenaming(r"attn_res\.mlp_queries\.(\d+)", r"layers.\1.mlp_input.query"),
        ]
    }
    monkeypatch.setattr(conversion_mapping, "get_checkpoint_conversion_mapping", lambda t: renames.get(t) or own(t))
    keys = [
        "model.llm.layers.0.attn.wq.weight",
        "model.llm.attn_res.mlp_queries.0",
        "model.llm.attn_res.mlp_queries.1",
        "model.llm.layers.1.attn.wq.weight",
        "model.llm.norm.weight",
    ]
    checkpoint = _checkpoint(tmp_path / "outside", "kept_outside", keys)
    assert sorted(checkpoint.layer_keys("model.layers", 0)) == sorted(keys[:2])
    assert sorted(checkpoint.layer_keys("model.layers", 1)) == sorted(keys[2:4])
    assert checkpoint.model_name(keys[2]) == "model.layers.1.mlp_input.query"


def test_inkling2_layer_queries_are_found_with_transformers_own_index_shift(tmp_path):
    """Inkling-2 (transformers 5.24): attn_res.attn_queries.N is layer N + 1's attention input
    query (a rename that shifts the index), attn_res.mlp_queries.N layer N's MLP input query."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "inkling2_text" not in CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no Inkling-2")
    keys = [
        "model.llm.layers.0.attn_norm.weight",
        "model.llm.layers.1.attn_norm.weight",
        "model.llm.attn_res.attn_queries.0",
        "model.llm.attn_res.mlp_queries.0",
        "model.llm.attn_res.mlp_queries.1",
        "model.llm.attn_res.output_query",
    ]
    checkpoint = _checkpoint(tmp_path / "inkling2", "inkling2_text", keys)
    assert sorted(checkpoint.layer_keys("model.layers", 0)) == sorted([keys[0], keys[3]])
    assert sorted(checkpoint.layer_keys("model.layers", 1)) == sorted([keys[1], keys[2], keys[4]])
    assert checkpoint.model_name(keys[2]) == "model.layers.1.attention_input.query"


def test_a_checkpoint_without_the_layers_tensors_is_refused_up_front(tmp_path):
    from pytest_layerparity.reference.support import check_checkpoint_names

    checkpoint = _checkpoint(tmp_path / "other", "llama", ["encoder.block.0.weight"])
    model = SimpleNamespace(
        layer_list=("model.layers", None),
        checkpoint=checkpoint,
        model_dir=tmp_path / "other",
        config_json={"architectures": ["LlamaForCausalLM"]},
    )
    with pytest.raises(ModelError, match=r"no tensors for layer 0 under the model's names .*'encoder.block.0.weight'"):
        check_checkpoint_names(model, [0, 1])


def test_a_model_that_switches_its_layers_attention_by_length_is_refused_naming_the_setting():
    from pytest_layerparity.reference.support import check_attention_mode

    model = _model("big_bird", attention_type="block_sparse", block_size=16, num_random_blocks=2)
    model.config_json = {"architectures": ["BigBirdForCausalLM"]}
    with pytest.raises(ModelError, match=r"for --seq-len 32 \(at most 144 tokens\) the model switches its layers"):
        check_attention_mode(model, 32)
    with pytest.raises(ModelError, match=r"for each decode step \(one token\)"):
        check_attention_mode(model, 512)
    check_attention_mode(_model("big_bird", attention_type="original_full"), 32)


class _Looped:
    """A model body that runs its middle layers ``passes`` times (a recurrent-depth model)."""

    def __init__(self, config):
        import torch

        self.config = config
        self.layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(5))

    def forward(self, hidden_states):
        start = self.config.n_input_layers
        end = start + self.config.n_recurrent_layers
        for layer in self.layers[:start]:
            hidden_states = layer(hidden_states)
        for _ in range(self.config.passes):
            for layer in self.layers[start:end]:
                hidden_states = layer(hidden_states)
        for layer in self.layers[end:]:
            hidden_states = layer(hidden_states)
        return hidden_states


class _Once:
    """Each layer once, the sequence cut into chunks where it is long (xLSTM's forward): the
    ``while`` depends on the input, not on the model."""

    def __init__(self):
        import torch

        self.layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(3))

    def forward(self, hidden_states, chunk=None):
        for step in range(1):
            hidden_states = hidden_states + step
        offset = 0
        while chunk is not None and offset < hidden_states.shape[1]:
            for layer in self.layers:
                hidden_states = layer(hidden_states)
            offset += chunk
        for layer in self.layers[: len(self.layers)]:
            hidden_states = layer(hidden_states)
        return hidden_states


class _LoopedByInput:
    """Loops over layers ``first`` to ``last``, given with the input: not known from the model."""

    def __init__(self):
        import torch

        self.layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(3))

    def forward(self, hidden_states, first=0, last=3):
        for _ in range(2):
            for layer in self.layers[first:last]:
                hidden_states = layer(hidden_states)
        return hidden_states


def _looped_model(owner, name: str):
    return SimpleNamespace(
        layer_list=("model.layers", owner.layers), layer_owner=owner, config_json={"architectures": [name]}
    )


def test_layers_a_model_runs_more_than_once_are_refused_up_front_naming_those_run_once():
    from pytest_layerparity.reference.support import check_recurrent_depth

    config = SimpleNamespace(n_input_layers=1, n_recurrent_layers=2, passes=3)
    model = _looped_model(_Looped(config), "LoopedForCausalLM")
    with pytest.raises(ModelError) as excinfo:
        check_recurrent_depth(model, [0, 1, 2, 3, 4])
    assert str(excinfo.value) == (
        "LoopedForCausalLM runs decoder layers 1-2 of model.layers more than once in one forward pass: "
        "_Looped.forward calls them inside the loop `for _ in range(self.config.passes)` (a recurrent-depth model); "
        "each run is another computation on another input and cache entry, and a golden holds one call per layer; "
        "test the layers it runs once with --layers 0,3-4"
    )
    with pytest.raises(ModelError, match=r"runs decoder layers 1-2 of model\.layers"):
        check_recurrent_depth(model, [2])
    check_recurrent_depth(model, [0, 3, 4])  # the layers it runs once
    config.n_recurrent_layers = 1  # read from the model as it is configured
    with pytest.raises(ModelError, match=r"runs decoder layer 1 of model\.layers .* --layers 0,2-4$"):
        check_recurrent_depth(model, [0, 1])
    check_recurrent_depth(model, [2])


def test_a_model_that_runs_each_layer_once_is_taken():
    from pytest_layerparity.reference.support import check_recurrent_depth

    check_recurrent_depth(_looped_model(_Once(), "OnceForCausalLM"), [0, 1, 2])


def test_a_loop_whose_layers_the_code_does_not_fix_refuses_every_layer():
    from pytest_layerparity.reference.support import check_recurrent_depth

    with pytest.raises(ModelError) as excinfo:
        check_recurrent_depth(_looped_model(_LoopedByInput(), "ByInputForCausalLM"), [0])
    assert str(excinfo.value).endswith(
        "runs decoder layers 0-2 of model.layers more than once in one forward pass: _LoopedByInput.forward calls "
        "them inside the loop `for _ in range(2)` (a recurrent-depth model); each run is another computation on "
        "another input and cache entry, and a golden holds one call per layer; no layer runs once: this model is "
        "not supported"
    )


@pytest.mark.parametrize(("model_type", "looped", "once"), [("dory", "1", "0,2"), ("inkling2_loop_text", "3", "0-2,4")])
def test_transformers_recurrent_depth_models_are_refused_up_front(model_type, looped, once):
    """Dory and Inkling-2-Loop (transformers 5.24) loop over a stretch of their layers: found
    in their forward's code and config, whichever transformers has them."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModel
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from pytest_layerparity.reference.support import check_recurrent_depth

    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"this transformers has no {model_type}")
    sizes = {"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}
    if model_type == "dory":
        config = AutoConfig.for_model(model_type, num_hidden_layers=3, n_input_layers=1, n_output_layers=1, **sizes)
    else:
        config = AutoConfig.for_model(
            model_type,
            num_hidden_layers=5,
            n_layers_per_attn_res_block=1,
            loop_layer_index_start=3,
            loop_layer_index_end=4,
            **sizes,
        )
    with init_empty_weights():
        owner = AutoModel.from_config(config, dtype=torch.float32)
    model = _looped_model(owner, f"{type(owner).__name__}ForCausalLM")
    with pytest.raises(ModelError, match=rf"runs decoder layer {looped} of model\.layers .* --layers {once}$"):
        check_recurrent_depth(model, list(range(len(owner.layers))))
