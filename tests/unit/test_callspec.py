from __future__ import annotations

import json
import math

import pytest
import torch

from pytest_layerparity.capture.calls import capture_calls
from pytest_layerparity.store.callspec import (
    CallRecord,
    cache_argument,
    decode_call,
    encode_call,
    encode_output,
    first_tensor,
    hidden_input_name,
    primary_output_name,
)
from pytest_layerparity.store.kv_updates import appended_kv


class Layer(torch.nn.Module):
    def forward(self, hidden, position_embeddings=None, attention_mask=None, cache=None, flag=True, scale=1.0):
        cos, sin = position_embeddings
        return (hidden * cos + sin * scale, None)


def test_capture_records_the_whole_call_and_replays_it():
    layer = Layer()
    hidden = torch.randn(2, 3, 4)
    cos, sin = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    records = {}
    with capture_calls({7: layer}, records.__setitem__):
        expected = layer(
            hidden, position_embeddings=(cos, sin), attention_mask=None, cache=object(), flag=False, scale=float("inf")
        )[0]
    assert layer._forward_hooks == {} and layer._forward_pre_hooks == {}
    record = records[7]
    assert sorted(record.tensors) == [
        "args.0",
        "kwargs.position_embeddings.0",
        "kwargs.position_embeddings.1",
        "output.0",
    ]
    spec = json.loads(json.dumps(record.spec))  # the spec survives JSON
    assert spec["kwargs"]["cache"] == {"dropped": "object"}
    args, kwargs = decode_call(spec, record.tensors)
    assert kwargs["flag"] is False and math.isinf(kwargs["scale"]) and kwargs["cache"] is None
    replay = first_tensor(Layer()(*args, **kwargs))
    assert torch.equal(replay, expected)
    assert primary_output_name(spec) == "output.0"
    assert hidden_input_name(spec) == "args.0"


def test_captured_tensors_are_copies():
    hidden = torch.zeros(2)
    record = CallRecord()
    encode_call((hidden,), {}, record)
    hidden += 1
    assert torch.equal(record.tensors["args.0"], torch.zeros(2))


def test_hooks_are_removed_when_the_forward_raises():
    layer = Layer()
    try:
        with capture_calls({0: layer}, lambda i, r: None):
            layer(torch.zeros(1))  # no position_embeddings: raises
    except TypeError:
        pass
    assert layer._forward_hooks == {} and layer._forward_pre_hooks == {}


def test_a_layer_run_twice_in_one_capture_is_refused():
    """A recurrent-depth model (transformers' Dory) runs some layers more than once per forward
    pass: a golden holds one call per layer, so the second run is refused, never overwritten."""
    from pytest_layerparity.errors import ModelError

    layer, pair = Layer(), (torch.ones(1, 2), torch.zeros(1, 2))
    with pytest.raises(ModelError, match="layer 3 ran more than once in one forward pass"):
        with capture_calls({3: layer}, lambda i, r: None):
            layer(torch.ones(1, 2), position_embeddings=pair)
            layer(torch.ones(1, 2), position_embeddings=pair)
    with capture_calls({3: layer}, lambda i, r: None):  # one run a capture
        layer(torch.ones(1, 2), position_embeddings=pair)


def test_output_tree_and_device_decoding():
    record = CallRecord()
    encode_call((), {"dtype": torch.bfloat16, "device": torch.device("cpu"), "ids": [torch.ones(1), 2]}, record)
    encode_output({"last": torch.ones(2), "aux": (torch.zeros(1),)}, record)
    _args, kwargs = decode_call(record.spec, record.tensors, device="cpu")
    assert kwargs["dtype"] is torch.bfloat16 and kwargs["device"] == torch.device("cpu")
    assert kwargs["ids"][1] == 2 and torch.equal(kwargs["ids"][0], torch.ones(1))
    assert primary_output_name(record.spec) == "output.last"


class _Attention(torch.nn.Module):
    """A layer that appends its keys and values to a transformers KV cache, as attention does."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, hidden_states, past_key_values=None):
        k = hidden_states.unsqueeze(1) * 2
        v = hidden_states.unsqueeze(1) * 3
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        return hidden_states + k.sum(-2).squeeze(1) + v.mean(-2).squeeze(1)


def test_a_kv_cache_is_stored_as_the_layers_past_and_replayed_as_a_fresh_cache():
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    past = torch.randn(1, 1, 5, 4)
    cache.update(torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4), 0)  # another layer's entry: not stored
    cache.update(past, past + 1, 2)
    layer = _Attention(2)
    records = {}
    x = torch.randn(1, 1, 4)
    with capture_calls({2: layer}, records.__setitem__):
        expected = layer(x, past_key_values=cache)
    record = records[2]
    node = record.spec["kwargs"]["past_key_values"]
    assert node == {
        "cache": {"layer": 2, "keys": "kwargs.past_key_values.keys", "values": "kwargs.past_key_values.values"}
    }
    assert torch.equal(record.tensors["kwargs.past_key_values.keys"], past)  # the past, before the call appended
    assert "states" not in record.spec["cache_update"]
    assert record.tensors["cache.new_keys"].shape == (1, 1, 1, 4)
    assert torch.equal(record.tensors["cache.new_keys"], x.unsqueeze(1) * 2)
    spec = json.loads(json.dumps(record.spec))
    args, kwargs = decode_call(spec, record.tensors)
    replayed = kwargs["past_key_values"]
    assert isinstance(replayed, DynamicCache) and replayed is not cache
    assert torch.equal(layer(*args, **kwargs), expected)
    new_keys, new_values = appended_kv(args, kwargs, spec, record.tensors)
    assert torch.equal(new_keys, record.tensors["cache.new_keys"])
    assert torch.equal(new_values, record.tensors["cache.new_values"])


def test_an_empty_kv_cache_replays_empty_and_a_call_without_one_records_no_update():
    from transformers.cache_utils import DynamicCache

    layer = _Attention(0)
    records = {}
    with capture_calls({0: layer}, records.__setitem__):
        layer(torch.randn(1, 3, 4), past_key_values=DynamicCache())
    first = records[0]
    with capture_calls({0: layer}, records.__setitem__):
        layer(torch.randn(1, 3, 4))
    assert first.spec["kwargs"]["past_key_values"] == {"cache": {"layer": 0}}
    assert first.tensors["cache.new_keys"].shape == (1, 1, 3, 4)  # the whole prompt was appended
    assert "cache_update" not in records[0].spec
    _, kwargs = decode_call(first.spec, first.tensors)
    assert len(kwargs["past_key_values"].layers) == 0


class _NewNameAttention(_Attention):
    """The same layer under transformers 5.24's name for the cache argument."""

    def forward(self, hidden_states, cache=None):
        return super().forward(hidden_states, past_key_values=cache)


def _sliding_cache(layer: int, window: int, seen: int):
    """A DynamicCache whose entry ``layer`` is a sliding-window one that has been given
    ``seen`` tokens (it holds the last ``window - 1``), as transformers keeps a sliding layer's."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache()
    entry = DynamicSlidingWindowLayer(sliding_window=window)
    cache.layers.extend([DynamicLayer() for _ in range(layer)] + [entry])
    entry.update(torch.randn(1, 1, seen, 4), torch.randn(1, 1, seen, 4))
    return cache


def test_a_replayed_window_longer_than_its_past_keeps_every_token_as_eager_torch_does():
    """The replay's entry keeps all it holds while that is under the window, without the slice
    from ``1 - window`` that a lazy device refuses; past the window it slides as transformers'."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    spec = {"args": [], "kwargs": {"cache": {"cache": {"layer": 0, "keys": "k", "values": "v", "sliding_window": 8}}}}
    tensors = {"k": torch.randn(1, 1, 3, 4), "v": torch.randn(1, 1, 3, 4)}
    _, kwargs = decode_call(spec, tensors)
    entry = kwargs["cache"].layers[0]
    reference = DynamicSlidingWindowLayer(sliding_window=8)
    reference.update(tensors["k"], tensors["v"])
    for step in range(7):
        new = torch.full((1, 1, 1, 4), float(step))
        got, want = entry.update(new, new), reference.update(new, new)
        assert torch.equal(got[0], want[0]) and torch.equal(entry.keys, reference.keys)
        assert entry.sliding_window == 8 and entry.cumulative_length == reference.cumulative_length
    assert entry.keys.shape[-2] == 7  # slid: the window's last 7 of 10


def test_a_sliding_window_entry_is_recorded_and_replayed_sliding():
    from transformers.cache_utils import DynamicSlidingWindowLayer

    cache = _sliding_cache(1, window=4, seen=6)
    layer = _NewNameAttention(1)
    x = torch.randn(1, 1, 4)
    records = {}
    with capture_calls({1: layer}, records.__setitem__):
        expected = layer(x, cache=cache)
    record = records[1]
    node = record.spec["kwargs"]["cache"]["cache"]  # a keyword argument named like the tag
    assert node["sliding_window"] == 4 and node["seen"] == 6
    assert record.tensors[node["keys"]].shape[-2] == 3  # the window's last 3 of 6
    assert record.tensors["cache.new_keys"].shape == (1, 1, 1, 4)  # one token appended, one dropped
    assert torch.equal(record.tensors["cache.new_keys"], x.unsqueeze(1) * 2)
    spec = json.loads(json.dumps(record.spec))
    args, kwargs = decode_call(spec, record.tensors)
    entry = kwargs["cache"].layers[1]
    assert isinstance(entry, DynamicSlidingWindowLayer) and entry.cumulative_length == 6
    assert torch.equal(layer(*args, **kwargs), expected)
    assert entry.keys.shape[-2] == 3 and entry.cumulative_length == 7  # it slid, as the reference's did
    new_keys, new_values = appended_kv(args, kwargs, spec, record.tensors)
    assert torch.equal(new_keys, record.tensors["cache.new_keys"])
    assert torch.equal(new_values, record.tensors["cache.new_values"])


class _TwoAttentionLayer(torch.nn.Module):
    """Decoder layer ``i`` of two attention blocks, each with a cache index of its own (``2i``
    and ``2i + 1``), as LongCat-Flash's layers are: entry ``i`` of the cache is not its own."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.first, self.second = _Attention(2 * index), _Attention(2 * index + 1)

    def forward(self, hidden_states, cache=None):
        return self.second(self.first(hidden_states, past_key_values=cache), past_key_values=cache)


def test_a_layer_whose_call_fills_several_cache_entries_is_replayed_with_all_of_their_past():
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    layers = {i: _TwoAttentionLayer(i) for i in range(2)}
    for layer in layers.values():  # the prompt: each entry gets its attention block's keys and values
        layer(torch.randn(1, 3, 4), cache=cache)
    cache.layers.append(type(cache.layers[0])())  # an entry beyond the layers': left out
    records = {}
    x = torch.randn(1, 1, 4)
    with capture_calls(layers, records.__setitem__):
        hidden = layers[0](x, cache=cache)
        expected = layers[1](hidden, cache=cache)
    record = records[1]
    node = record.spec["kwargs"]["cache"]["cache"]
    assert [n["layer"] for n in [node, *node["more"]]] == [2, 3]  # not entry 1, layer 0's second block's
    assert torch.equal(record.tensors[node["keys"]], cache.layers[2].keys[..., :3, :])  # the past before the call
    assert record.spec["cache_update"]["layers"] == [2, 3]
    assert record.tensors["cache.new_keys"].shape == (1, 1, 2, 4)  # one token for each entry
    spec = json.loads(json.dumps(record.spec))
    args, kwargs = decode_call(spec, record.tensors)
    assert torch.equal(_TwoAttentionLayer(1)(*args, **kwargs), expected)
    new_keys, new_values = appended_kv(args, kwargs, spec, record.tensors)
    assert torch.equal(new_keys, record.tensors["cache.new_keys"])
    assert torch.equal(new_values, record.tensors["cache.new_values"])
    assert records[0].spec["cache_update"]["layers"] == [0, 1]


def test_a_call_is_replayed_under_the_cache_name_the_callee_takes():
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    cache.update(torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4), 0)
    records = {}
    x = torch.randn(1, 1, 4)
    layer = _Attention(0)
    with capture_calls({0: layer}, records.__setitem__):
        expected = layer(x, past_key_values=cache)  # recorded under the old name
    spec = json.loads(json.dumps(records[0].spec))
    renamed = _NewNameAttention(0)
    assert cache_argument(renamed) == "cache" and cache_argument(layer) == "past_key_values"
    args, kwargs = decode_call(spec, records[0].tensors, cache_name=cache_argument(renamed))
    assert sorted(kwargs) == ["cache"]
    assert torch.equal(renamed(*args, **kwargs), expected)
    new_keys, _ = appended_kv(args, kwargs, spec, records[0].tensors)
    assert torch.equal(new_keys, records[0].tensors["cache.new_keys"])
    _, kwargs = decode_call(spec, records[0].tensors)  # no name given: as recorded
    assert sorted(kwargs) == ["past_key_values"]


def test_the_cache_name_is_read_through_wrappers_and_falls_back_where_none_is_named():
    import functools

    def deprecated(fn):  # as transformers' deprecate_kwarg wraps a layer's forward
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)

        return wrapper

    class Wrapped(torch.nn.Module):
        @deprecated
        def forward(self, hidden_states, cache=None, **kwargs):
            return hidden_states

    class PassesKwargsOn(torch.nn.Module):
        def forward(self, hidden_states, **kwargs):
            return hidden_states

    assert cache_argument(Wrapped()) == "cache"
    assert cache_argument(PassesKwargsOn(), "past_key_values") == "past_key_values"
    assert cache_argument(PassesKwargsOn()) is None


class _LinearMixer(torch.nn.Module):
    """A linear-attention mixer as transformers' are written: a causal convolution over the
    cache's convolution state and the new tokens, then a recurrent state updated from it (both
    in place in the cache entry)."""

    def __init__(self, index: int, kernel: int = 3) -> None:
        super().__init__()
        self.index, self.kernel = index, kernel

    def forward(self, hidden_states, cache=None):
        window = cache.update_conv_state(hidden_states.transpose(1, 2), self.index, conv_kernel_size=self.kernel)
        previous = cache.layers[self.index].recurrent_states[0]  # None before the first step
        before = previous if previous is not None else 0
        state = 0.5 * before + window[..., -self.kernel :].sum(-1)
        cache.update_recurrent_state(state, self.index)
        return hidden_states * 2 + state.unsqueeze(1)


def _linear_cache(kind: str, layer: int):
    from transformers import cache_utils
    from transformers.cache_utils import DynamicCache, DynamicLayer

    cache = DynamicCache()
    made = getattr(cache_utils, kind)
    cache.layers.extend([DynamicLayer() for _ in range(layer)] + [made(number_of_states=1)])
    return cache


@pytest.mark.parametrize("kind", ["LinearAttentionLayer", "LinearAttentionAndFullAttentionLayer"])
def test_a_linear_attention_entry_is_stored_as_its_states_and_replayed_with_copies(kind):
    cache = _linear_cache(kind, 1)
    mixer = _LinearMixer(1)
    mixer(torch.randn(1, 5, 4), cache=cache)  # the prompt: the entry now holds both states
    conv, recurrent = cache.layers[1].conv_states[0].clone(), cache.layers[1].recurrent_states[0].clone()
    x = torch.randn(1, 1, 4)
    records = {}
    with capture_calls({1: mixer}, records.__setitem__):
        expected = mixer(x, cache=cache)
    record = records[1]
    node = record.spec["kwargs"]["cache"]["cache"]
    linear = node["linear"]
    assert linear["kind"] == kind and linear["states"] == 1 and linear["previous"] == [0]
    assert linear["conv"][0]["kernel"] == 3
    assert torch.equal(record.tensors[linear["conv"][0]["t"]], conv)  # as the call found it, not as it left it
    assert torch.equal(record.tensors[linear["recurrent"][0]["t"]], recurrent)
    # what the step wrote to the entry stands for appended keys and values: its states after it
    assert record.spec["cache_update"]["states"] is True
    after = cache.layers[1]
    assert torch.equal(record.tensors["cache.new_keys"], after.conv_states[0].reshape(1, -1))
    assert torch.equal(record.tensors["cache.new_values"], after.recurrent_states[0].reshape(1, -1))
    assert not torch.equal(after.recurrent_states[0], recurrent)
    spec = json.loads(json.dumps(record.spec))
    for _ in range(2):  # each replay updates its own copies: the stored states stay as stored
        args, kwargs = decode_call(spec, record.tensors)
        entry = kwargs["cache"].layers[1]
        assert type(entry).__name__ == kind
        assert torch.equal(mixer(*args, **kwargs), expected)
        new_conv, new_recurrent = appended_kv(args, kwargs, spec, record.tensors)
        assert torch.equal(new_conv, record.tensors["cache.new_keys"])
        assert torch.equal(new_recurrent, record.tensors["cache.new_values"])
    assert torch.equal(record.tensors[linear["recurrent"][0]["t"]], recurrent)
    record.tensors[linear["recurrent"][0]["t"]] = torch.zeros_like(recurrent)  # the state is what the step reads
    args, kwargs = decode_call(spec, record.tensors)
    assert not torch.equal(mixer(*args, **kwargs), expected)


def test_stacked_runs_of_a_linear_attention_step_take_the_states_of_each_sample():
    from pytest_layerparity.noise.batching import stacked_call

    cache = _linear_cache("LinearAttentionLayer", 0)
    mixer = _LinearMixer(0)
    mixer(torch.randn(2, 5, 4), cache=cache)
    records = {}
    with capture_calls({0: mixer}, records.__setitem__):
        expected = mixer(torch.randn(2, 1, 4), cache=cache)
    record = records[0]
    args, kwargs = decode_call(record.spec, stacked_call(record.spec, record.tensors, 3))
    assert torch.equal(mixer(*args, **kwargs), expected.repeat(3, 1, 1))


def test_a_layer_without_attention_is_stored_with_its_empty_entry_and_replayed_with_none():
    """A hybrid's MLP layer gets transformers' empty entry (DummyLayer, 5.24 on): nothing to
    store, no update, and its replay gets an empty cache."""
    from transformers import cache_utils
    from transformers.cache_utils import DynamicCache

    if not hasattr(cache_utils, "DummyLayer"):
        pytest.skip("this transformers has no empty cache entry")
    cache = DynamicCache()
    cache.layers.append(cache_utils.DummyLayer())
    mlp = _MLPLayer()
    records = {}
    with capture_calls({0: mlp}, records.__setitem__):
        expected = mlp(torch.randn(1, 1, 4), cache=cache)
    record = records[0]
    assert record.spec["kwargs"]["cache"] == {"cache": {"layer": 0}} and "cache_update" not in record.spec
    args, kwargs = decode_call(json.loads(json.dumps(record.spec)), record.tensors)
    assert len(kwargs["cache"].layers) == 0 and torch.equal(mlp(*args, **kwargs), expected)


class _MLPLayer(torch.nn.Module):
    def forward(self, hidden_states, cache=None):
        return hidden_states * 3


def test_state_kept_elsewhere_in_a_models_own_cache_class_is_refused_naming_it():
    """MiniMax's lightning-attention layers keep their state in a list of the model's own
    cache class and append nothing to their entry: replayed as a DynamicCache the state would
    be gone, so the call is refused; the same class's attention layers append as usual."""
    from transformers.cache_utils import DynamicCache

    from pytest_layerparity.store.callspec import UnstorableCache

    class SideCache(DynamicCache):
        def __init__(self):
            super().__init__()
            self.side = {}

    class SideLayer(torch.nn.Module):
        def forward(self, hidden_states, cache=None):
            cache.side[0] = cache.side.get(0, 0) + hidden_states.sum(1)
            return hidden_states + cache.side[0].unsqueeze(1)

    cache, side, attention = SideCache(), SideLayer(), _NewNameAttention(1)
    records = {}
    with pytest.raises(UnstorableCache, match=r"layer 0 was given a SideCache and appended nothing .*--decode-steps 0"):
        with capture_calls({0: side}, records.__setitem__):
            side(torch.randn(1, 1, 4), cache=cache)
    with capture_calls({1: attention}, records.__setitem__):
        attention(torch.randn(1, 1, 4), cache=cache)
    assert records[1].tensors["cache.new_keys"].shape == (1, 1, 1, 4)


def test_state_beyond_keys_and_values_is_refused_naming_the_entry():
    from transformers.cache_utils import DynamicCache

    class RecurrentLayer:  # an entry of a kind a golden cannot store (an indexer's keys, a static entry)
        conv_states = torch.zeros(1)

    cache = DynamicCache()
    cache.layers.append(RecurrentLayer())
    record = CallRecord()
    with pytest.raises(ValueError, match=r"layer 0.s KV-cache entry is a RecurrentLayer: .*--decode-steps 0 "):
        encode_call((torch.zeros(1),), {"cache": cache}, record, cache_layer=0)


class _DecoderAttention(_Attention):
    """A BERT-family decoder layer's self-attention: it appends to the self-attention part of
    the EncoderDecoderCache it is given."""

    def forward(self, hidden_states, past_key_values=None):
        return super().forward(hidden_states, past_key_values.self_attention_cache if past_key_values else None)


def test_an_encoder_decoder_cache_without_an_encoder_is_stored_as_its_self_attention_part():
    """RoCBert's decoder takes an EncoderDecoderCache always: its self-attention part is the
    layer's past (stored, and replayed inside a new EncoderDecoderCache); without it the decode
    step replayed with no past at all (cosine 0.88 on a correct port)."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    own = DynamicCache()
    past = torch.randn(1, 1, 5, 4)
    own.update(past, past + 1, 0)
    layer = _DecoderAttention(0)
    records = {}
    x = torch.randn(1, 1, 4)
    with capture_calls({0: layer}, records.__setitem__):
        expected = layer(x, past_key_values=EncoderDecoderCache(own, DynamicCache()))
    record = records[0]
    assert record.spec["kwargs"]["past_key_values"]["cache"]["within"] == "EncoderDecoderCache"
    assert torch.equal(record.tensors["kwargs.past_key_values.keys"], past)
    spec = json.loads(json.dumps(record.spec))
    args, kwargs = decode_call(spec, record.tensors)
    assert isinstance(kwargs["past_key_values"], EncoderDecoderCache)
    assert torch.equal(layer(*args, **kwargs), expected)
    new_keys, _ = appended_kv(args, kwargs, spec, record.tensors)
    assert torch.equal(new_keys, record.tensors["cache.new_keys"])


def test_a_cache_that_cannot_be_stored_is_refused_not_dropped():
    """An encoder's cross-attention keys beside the layer's own, or a cache object of no known
    kind: replayed without it a decode step computes something else, so the recording refuses."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    from pytest_layerparity.store.callspec import UnstorableCache, encode

    cross = DynamicCache()
    cross.update(torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), 0)
    with pytest.raises(UnstorableCache, match="cross-attention keys and values beside its own"):
        encode(EncoderDecoderCache(DynamicCache(), cross), "kwargs.cache", {}, cache_layer=0)

    class OtherCache:
        pass

    with pytest.raises(UnstorableCache, match="the layer's KV cache is a OtherCache"):
        encode(OtherCache(), "kwargs.cache", {}, cache_layer=0)
    assert encode(OtherCache(), "kwargs.thing", {}) == {"dropped": "OtherCache"}  # not a layer's call: kept as before
