from __future__ import annotations

import json
import math

import torch

from pytest_layerparity.capture.calls import capture_calls
from pytest_layerparity.store.callspec import (
    CallRecord,
    decode_call,
    encode_call,
    encode_output,
    first_tensor,
    hidden_input_name,
    primary_output_name,
)


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


def test_output_tree_and_device_decoding():
    record = CallRecord()
    encode_call((), {"dtype": torch.bfloat16, "device": torch.device("cpu"), "ids": [torch.ones(1), 2]}, record)
    encode_output({"last": torch.ones(2), "aux": (torch.zeros(1),)}, record)
    _args, kwargs = decode_call(record.spec, record.tensors, device="cpu")
    assert kwargs["dtype"] is torch.bfloat16 and kwargs["device"] == torch.device("cpu")
    assert kwargs["ids"][1] == 2 and torch.equal(kwargs["ids"][0], torch.ones(1))
    assert primary_output_name(record.spec) == "output.last"
