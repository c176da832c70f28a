"""The prompt's KV cache filled by the capturing forward (reference/prompt_cache.py): the
captured calls are the model's own, the cache is what the model's cached forward makes."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pytest_layerparity.capture.calls import capture_calls
from pytest_layerparity.reference.prompt_cache import filled, filling, prompt_cache, with_or_without
from pytest_layerparity.store.callspec import cache_argument, returned_cache


def _model(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = LlamaConfig(**{**sizes, "num_hidden_layers": 2, "vocab_size": 64, **overrides})
    return LlamaForCausalLM(config).eval()


def test_the_capturing_forward_fills_the_cache_out_of_the_captures_sight():
    model = _model()
    layers = model.model.layers
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    name = cache_argument(layers[0])
    cache = prompt_cache(model, layers, name)
    seen, plain = {}, {}
    with torch.no_grad():
        with capture_calls(dict(enumerate(layers)), seen.__setitem__), filling(layers, cache, name):
            logits = model(input_ids=ids, use_cache=False).logits
        with capture_calls(dict(enumerate(layers)), plain.__setitem__):
            model(input_ids=ids, use_cache=False)
        cached = returned_cache(model(input_ids=ids, use_cache=True))
    assert filled(cache, len(layers), 9) and not filled(cache, len(layers), 10)
    for i in range(len(layers)):  # the calls as the model made them: no cache, nothing appended
        assert seen[i].spec == plain[i].spec
        assert seen[i].tensors.keys() == plain[i].tensors.keys()
        assert all(torch.equal(seen[i].tensors[k], plain[i].tensors[k]) for k in plain[i].tensors)
        assert torch.equal(cache.layers[i].keys, cached.layers[i].keys)
        assert torch.equal(cache.layers[i].values, cached.layers[i].values)
    assert logits.shape == (1, 9, 64)


def test_no_cache_where_the_model_is_not_all_attention_or_takes_none():
    layers = _model().model.layers
    assert prompt_cache(_model(), layers, None) is None  # a layer without a cache argument
    hybrid = _model()
    hybrid.config.layer_types = ["full_attention", "linear_attention"]
    assert prompt_cache(hybrid, layers, "cache") is None
    assert prompt_cache(torch.nn.Linear(2, 2), layers, "cache") is None  # not a generation model
    assert not filled(None, 2, 9)


def test_without_a_cache_filling_changes_nothing():
    model = _model()
    with filling(model.model.layers, None, "cache"):
        assert not any(layer._forward_pre_hooks for layer in model.model.layers)


@pytest.mark.parametrize("given", [True, False])
def test_a_layer_called_with_a_cache_keeps_its_own(given):
    model = _model()
    layers = model.model.layers
    name = cache_argument(layers[0])
    mine = prompt_cache(model, layers, name)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), filling(layers, mine, name):
        out = model(input_ids=ids, use_cache=given)
    assert filled(mine, len(layers), 5) is not given  # the model's own cache went to its layers
    if given:
        assert filled(returned_cache(out), len(layers), 5)


def test_a_layer_that_takes_its_cache_positionally_is_left_as_called():
    """GPT-2's blocks take the cache as their second positional argument: handing it under its
    name too would call them with it twice; they are left as called and the cache stays empty."""

    class Block(torch.nn.Module):
        def forward(self, hidden, cache=None, mask=None):
            if cache is not None:
                cache.update(hidden[:, None], hidden[:, None], 0)
            return hidden

    block = torch.nn.ModuleList([Block()])
    cache = prompt_cache(_model(num_hidden_layers=1), block, "cache")
    with filling(block, cache, "cache"):
        block[0](torch.ones(1, 3, 4), None, None)
    assert not filled(cache, 1, 3)
    with filling(block, cache, "cache"):
        block[0](torch.ones(1, 3, 4), mask=None)
    assert filled(cache, 1, 3)


def test_a_forward_that_refuses_the_cache_runs_again_without_it():
    calls = []

    def forward(cache):
        calls.append(cache)
        if cache is not None:
            raise AttributeError("'DynamicCache' object has no attribute 'self_attention_cache'")
        return "output"

    assert with_or_without(forward, "a cache") == ("output", None) and calls == ["a cache", None]
    assert with_or_without(lambda cache: cache, None) == (None, None)
    with pytest.raises(ValueError, match="its own"):  # a failure without one is the model's
        with_or_without(lambda cache: (_ for _ in ()).throw(ValueError("its own")), None)
