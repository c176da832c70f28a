"""The keys and values a prompt's call writes, kept in its golden (store/promptkv.py): taken
from the past the first decode step found, replayed with an empty cache of the reference's
kind, judged as a decode step's appended keys and values are."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pytest_layerparity.capture.calls import capture_calls
from pytest_layerparity.compare.judge import judge_appended_kv
from pytest_layerparity.compare.verdict import Check
from pytest_layerparity.options import make_settings
from pytest_layerparity.reference.prompt_cache import filling, prompt_cache
from pytest_layerparity.report.text import failure_text
from pytest_layerparity.store import promptkv
from pytest_layerparity.store.callspec import CallRecord, cache_argument, decode_call, first_tensor
from pytest_layerparity.store.kv_updates import appended_kv


def _model(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    return LlamaForCausalLM(LlamaConfig(**{**sizes, "num_hidden_layers": 2, "vocab_size": 64, **overrides})).eval()


def _prompt_and_first_step(model: LlamaForCausalLM, tokens: int = 7) -> tuple[dict, dict]:
    """Each layer's prompt call (the model's forward without a cache, one filled out of the
    capture's sight as extraction does) and its first decode step's call."""
    layers = model.model.layers
    name = cache_argument(layers[0])
    cache = prompt_cache(model, layers, name)
    ids = torch.randint(0, 64, (1, tokens), generator=torch.Generator().manual_seed(1))
    prompts: dict[int, CallRecord] = {}
    steps: dict[int, CallRecord] = {}
    with torch.no_grad():
        with capture_calls(dict(enumerate(layers)), prompts.__setitem__), filling(layers, cache, name):
            logits = model(input_ids=ids, use_cache=False).logits
        with capture_calls(dict(enumerate(layers)), steps.__setitem__):
            model(input_ids=logits[:, -1:].argmax(-1), **{name: cache}, use_cache=True)
    return prompts, steps


def test_a_prompts_keys_and_values_replay_exactly_with_an_empty_cache_and_the_output_stays():
    model = _model()
    prompts, steps = _prompt_and_first_step(model)
    for index, layer in enumerate(model.model.layers):
        prompt = prompts[index]
        promptkv.attach(prompt, steps[index], None)
        spec = json.loads(json.dumps(prompt.spec))  # as the golden stores it
        name = cache_argument(layer)  # (transformers 5.24's "cache", "past_key_values" before)
        assert spec["prompt_cache"] == {"cache": {"layer": index, "empty": True}, "argument": name}
        assert spec["cache_update"] == {"layer": index, "keys": "cache.new_keys", "values": "cache.new_values"}
        assert prompt.tensors["cache.new_keys"].shape == (1, 2, 7, 8)
        args, kwargs = decode_call(spec, prompt.tensors)
        with torch.no_grad():
            out = first_tensor(layer(*args, **kwargs))
        assert torch.equal(out, prompt.tensors["output"])  # the output as without a cache
        written = appended_kv(args, kwargs, spec, prompt.tensors)
        assert torch.equal(written[0], prompt.tensors["cache.new_keys"])
        assert torch.equal(written[1], prompt.tensors["cache.new_values"])
        args, kwargs = decode_call(spec, prompt.tensors, prompt_cache=False)
        assert kwargs[name] is None  # the call as the capture recorded it


def test_a_sliding_entry_is_replayed_empty_and_sliding():
    model = _model(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    prompts, steps = _prompt_and_first_step(model)
    prompt = prompts[0]
    promptkv.attach(prompt, steps[0], None)
    assert prompt.spec["prompt_cache"]["cache"] == {"layer": 0, "empty": True, "sliding_window": 4, "seen": 0}
    assert prompt.tensors["cache.new_keys"].shape[-2] == 3  # the window's last tokens, as the entry held them
    args, kwargs = decode_call(prompt.spec, prompt.tensors)
    with torch.no_grad():
        model.model.layers[0](*args, **kwargs)
    assert type(kwargs[cache_argument(model.model.layers[0])].layers[0]).__name__ == "ClampedSlidingWindowLayer"
    written = appended_kv(args, kwargs, prompt.spec, prompt.tensors)
    assert torch.equal(written[0], prompt.tensors["cache.new_keys"])


def _step(node: dict, tensors: dict | None = None) -> CallRecord:
    return CallRecord(tensors=tensors or {}, spec={"args": [], "kwargs": {"cache": {"cache": node}}})


def _prompt() -> CallRecord:
    return CallRecord(spec={"args": [{"t": "args.0"}], "kwargs": {"cache": {"v": None}}})


KV = {"kwargs.cache.keys": torch.ones(1, 2, 3, 4), "kwargs.cache.values": torch.zeros(1, 2, 3, 4)}
PAST = {"layer": 5, "keys": "kwargs.cache.keys", "values": "kwargs.cache.values"}
NO_STEP = "no decode step of this layer was captured (the prompt's keys and values are those it starts from)"


@pytest.mark.parametrize(
    ("step", "refusal", "why"),
    [
        (_step(PAST, KV), "a refusal", "a refusal"),
        (None, None, NO_STEP),
        (_step({"layer": 5}), None, "the layer wrote no keys and values to its cache entry in the prompt"),
        (
            _step({**PAST, "linear": {"kind": "LinearAttentionLayer"}}, KV),
            None,
            "the layer's cache entry holds linear attention's states, not known to leave its output as it is",
        ),
        (
            CallRecord(tensors=KV, spec={"args": [{"cache": PAST}], "kwargs": {}}),
            None,
            "the model does not pass the layer its cache by keyword (a replay could not give it one)",
        ),
    ],
)
def test_where_the_first_steps_past_does_not_show_what_the_prompt_wrote_the_golden_says_why(step, refusal, why):
    prompt = _prompt()
    promptkv.attach(prompt, step, refusal)
    assert prompt.spec["prompt_cache"] == {"not_stored": why}
    assert "cache_update" not in prompt.spec and "cache.new_keys" not in prompt.tensors
    assert promptkv.unjudged(prompt.spec, torch.nn.Identity(), "cache") == why


def test_a_layer_of_several_entries_writes_each_joined():
    more = {"layer": 6, "keys": "kwargs.cache.6.keys", "values": "kwargs.cache.6.values", "sliding_window": 8}
    tensors = {**KV, "kwargs.cache.6.keys": torch.full((1, 2, 3, 4), 2.0)}
    tensors["kwargs.cache.6.values"] = torch.ones(1, 2, 3, 4)
    prompt = _prompt()
    promptkv.attach(prompt, _step({**PAST, "more": [more]}, tensors), None)
    cache = prompt.spec["prompt_cache"]["cache"]
    assert cache == {"layer": 5, "empty": True, "more": [{"layer": 6, "empty": True, "sliding_window": 8, "seen": 0}]}
    assert prompt.spec["cache_update"]["layers"] == [5, 6]
    assert prompt.tensors["cache.new_keys"].shape == (1, 2, 6, 4)


class TakesNoCache(torch.nn.Module):
    def forward(self, hidden_states, position_ids=None):
        return hidden_states


class TakesKwargs(torch.nn.Module):
    def forward(self, hidden_states, **kwargs):
        return hidden_states


def test_an_old_store_or_a_layer_that_takes_no_cache_is_not_judged_and_says_why():
    prompt = _prompt()
    promptkv.attach(prompt, _step(PAST, KV), None)
    assert promptkv.unjudged(prompt.spec, TakesKwargs(), None) is None  # the reference's name for it
    assert promptkv.unjudged(prompt.spec, TakesNoCache(), None) == (
        "the layer under test takes no cache argument (cache) and no **kwargs"
    )
    assert promptkv.unjudged(_prompt().spec, TakesKwargs(), "cache") == promptkv.OLD_STORE
    assert promptkv.written(None, None, prompt.spec, {}, "why") == (None, "not judged: why")
    nothing = promptkv.written([], {"cache": None}, prompt.spec, prompt.tensors, None)  # a cache left empty
    assert nothing == (None, f"not judged: {promptkv.NOTHING_WRITTEN}")


def test_the_prompts_checks_are_named_apart_from_a_decode_steps():
    keys, values = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    golden = {"cache.new_keys": keys.bfloat16(), "cache.new_values": values.bfloat16()}
    golden.update({"floor.cache.new_keys": keys, "floor.cache.new_values": values})
    settings = make_settings()
    swapped = golden["cache.new_keys"][:, [1, 0]]  # head 0's keys written as head 1's
    checks = judge_appended_kv(golden, (swapped, golden["cache.new_values"]), settings, "bfloat16", prefix="prompt_")
    assert [(c.name, c.ok) for c in checks] == [
        ("prompt_keys_cosine", False),
        ("prompt_keys_noise_ratio", False),
        ("prompt_values_cosine", True),
        ("prompt_values_noise_ratio", True),
    ]
    nothing = judge_appended_kv(golden, None, settings, "bfloat16", prefix="prompt_")
    assert [(c.name, c.ok) for c in nothing] == [("prompt_kv_written", False)]


CACHE_ALONE = "the keys and values it wrote to its KV cache differ from the golden's"


@pytest.mark.parametrize(
    ("failing", "headline"),
    [
        (["prompt_keys_noise_ratio"], CACHE_ALONE),
        (["new_keys_cosine", "kv_cache_appended"], CACHE_ALONE),
        (["noise_ratio", "prompt_keys_noise_ratio"], "output differs from the golden"),
        (["noise_ratio"], "output differs from the golden"),
    ],
)
def test_a_failure_of_the_cache_alone_says_so(failing, headline):
    from pytest_layerparity.compare.judge import judge

    outcome = judge(2, torch.ones(1, 2, 4), torch.ones(1, 2, 4), make_settings(), "bfloat16")
    outcome.checks = [Check(name, 2.0, "<=", 1.0, False) for name in failing]
    assert failure_text(outcome, "on cpu", "pytest").splitlines()[0] == f"layer 2 on cpu: {headline}"
