from __future__ import annotations

from types import SimpleNamespace

import pytest

from pytest_layerparity.errors import ModelError
from pytest_layerparity.reference.support import check_decode_cache


def _model(model_type: str, **fields):
    from transformers import AutoConfig

    return SimpleNamespace(hf_config=AutoConfig.for_model(model_type, **fields))


def test_linear_attention_layers_are_taken_and_an_indexed_entry_is_refused_up_front_naming_the_fix():
    """Qwen3-Next's linear-attention entries hold states a golden stores; DeepSeek-V3.2's
    indexed entries hold an indexer's keys, which it does not."""
    check_decode_cache(_model("qwen3_next", num_hidden_layers=4), [0, 1, 2, 3], decode_steps=2)
    model = _model("deepseek_v32", num_hidden_layers=2)
    with pytest.raises(ModelError) as excinfo:
        check_decode_cache(model, [1], decode_steps=2)
    assert str(excinfo.value) == (
        "--decode-steps 2: layer 1's KV-cache entry is a DynamicIndexedLayer: it holds state beyond keys and "
        "values, which a decode-step golden cannot store; extract with --decode-steps 0 (the prompt tests and the "
        "whole model's prompt still run)"
    )
    check_decode_cache(model, [0, 1], decode_steps=0)  # no decode steps asked for


def test_an_empty_entry_is_taken_for_a_layer_without_attention():
    """Nemotron-H's MLP and mixture-of-experts layers get an empty entry: nothing to replay."""
    kinds = ["linear_attention", "moe", "full_attention", "mlp"]
    check_decode_cache(_model("nemotron_h", num_hidden_layers=4, layer_types=kinds), [0, 1, 2, 3], decode_steps=2)


@pytest.mark.skipif(
    not hasattr(__import__("transformers.cache_utils").cache_utils, "DummyLayer"),
    reason="this transformers makes no empty cache entries",
)
def test_an_empty_entry_of_a_layer_that_reads_other_layers_keys_is_refused_naming_the_fix():
    """Gemma-3n's last layers get an empty entry because they read the keys and values earlier
    layers store: refused up front."""
    gemma = ["sliding_attention", "full_attention"] * 3
    shared = _model("gemma3n_text", num_hidden_layers=6, num_kv_shared_layers=2, layer_types=gemma)
    check_decode_cache(shared, [0, 1, 2, 3], decode_steps=2)
    with pytest.raises(ModelError) as excinfo:
        check_decode_cache(shared, [4], decode_steps=2)
    assert str(excinfo.value) == (
        "--decode-steps 2: layer 4 reads the keys and values another layer stores (its own KV-cache entry is empty), "
        "which a decode-step golden of this layer cannot hold; extract with --decode-steps 0 (the prompt tests and "
        "the whole model's prompt still run)"
    )


@pytest.mark.parametrize(
    ("model_type", "model_class"), [("openai-gpt", "OpenAIGPTLMHeadModel"), ("rwkv", "RwkvForCausalLM")]
)
def test_decode_steps_of_a_model_that_takes_no_kv_cache_are_refused_up_front(model_type, model_class):
    """Models whose forward keeps no transformers cache (none at all, or state of their own)
    have no decode-step call to record: refused before any work, not dropped in silence."""
    with pytest.raises(ModelError) as excinfo:
        check_decode_cache(_model(model_type), [0], decode_steps=2)
    assert str(excinfo.value) == (
        f"--decode-steps 2: {model_class}.forward takes no KV cache (no `cache` or `past_key_values` argument): a "
        "decode-step golden is a layer's call with the past keys and values of a transformers cache, which this "
        "model does not keep; extract with --decode-steps 0"
    )
    check_decode_cache(_model(model_type), [0], decode_steps=0)


def test_sliding_window_and_full_attention_layers_are_taken():
    check_decode_cache(_model("gemma2", num_hidden_layers=3), [0, 1, 2], decode_steps=2)
    check_decode_cache(_model("llama", num_hidden_layers=2), [0, 1], decode_steps=2)


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


def _gemma2(out, softcapping):
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        attn_logit_softcapping=softcapping,
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config)
    with torch.no_grad():  # attention logits of order 10, where a cap of 5 bites
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30)
            layer.self_attn.k_proj.weight.mul_(30)
    model.save_pretrained(out)
    return out


def test_a_soft_capped_attention_runs_eager_so_that_the_capping_is_computed(tmp_path):
    """Transformers before 5.24 ran Gemma-2 through SDPA by default, which leaves its logit
    soft-capping out: the reference and the target's own layers would compute another model."""
    import torch

    from pytest_layerparity.model.build import capped_attention, load_hf_config, model_class_for
    from pytest_layerparity.model.source import ModelSource

    source = ModelSource(_gemma2(tmp_path / "capped", 5.0))
    assert source.hf_config._attn_implementation == "eager"
    assert source.layer_config._attn_implementation == "eager"
    assert ModelSource(source.model_dir, attn_implementation="sdpa").hf_config._attn_implementation == "sdpa"
    model = model_class_for(source.hf_config).from_pretrained(str(source.model_dir), config=source.hf_config).eval()
    ids = torch.arange(12).unsqueeze(0)
    with torch.no_grad():
        capped = model(ids).logits
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = model(ids).logits
    assert (capped - uncapped).abs().max() > 1e-3  # the capping is in what the model computes
    plain = ModelSource(_gemma2(tmp_path / "plain", None))  # no capping: the library's default
    assert plain.hf_config._attn_implementation == load_hf_config(plain.model_dir)._attn_implementation
    assert capped_attention(source.hf_config) == "eager" and capped_attention(plain.hf_config) is None  # --plan's
