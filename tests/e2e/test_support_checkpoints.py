"""Up-front refusals that read a written checkpoint or need a fresh process: a layer's
tensors found under the names transformers gives them as it loads, a checkpoint without the
layer's tensors, and a cache entry that a modeling module registers when imported."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pytest_layerparity.errors import ModelError


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

    from pytest_layerparity.model.checkpoint import Checkpoint

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
