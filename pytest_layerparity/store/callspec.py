"""How a module's whole call (every positional and keyword argument, and the output) is
stored: flat tensors plus a JSON spec that rebuilds it (the golden format's call).

A spec node is one of::

    {"t": "args.0"}            a tensor, stored under that name
    {"v": <json scalar>}       None, bool, int, float (non-finite floats as strings), str
    {"tuple": [...]} / {"list": [...]} / {"dict": {...}}
    {"dtype": "bfloat16"} / {"device": "cpu"}
    {"dropped": "DynamicCache"}  an object that cannot be stored; replayed as None
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Device = str | torch.device


@dataclass
class CallRecord:
    """One captured call: flat CPU tensors and the spec that rebuilds args, kwargs, output."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    spec: dict[str, Any] = field(default_factory=dict)


def _encode_scalar(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    return value


def _decode_scalar(value: Any) -> Any:
    if isinstance(value, dict) and "float" in value:
        return float(value["float"])
    return value


def encode(value: Any, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Encode ``value`` into a spec node, storing tensors into ``tensors`` (as CPU copies)."""
    if isinstance(value, torch.Tensor):
        tensors[name] = value.detach().to("cpu", copy=True)
        return {"t": name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"v": _encode_scalar(value)}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, Mapping):
        return {"dict": {str(k): encode(v, f"{name}.{k}", tensors) for k, v in value.items()}}
    if isinstance(value, tuple):
        return {"tuple": [encode(v, f"{name}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return {"list": [encode(v, f"{name}.{i}", tensors) for i, v in enumerate(value)]}
    return {"dropped": type(value).__name__}


def decode(node: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], device: Device | None = None) -> Any:
    """Rebuild a value from its spec node; tensors are moved to ``device`` when given."""
    if "t" in node:
        tensor = tensors[node["t"]]
        return tensor.to(device) if device is not None else tensor
    if "v" in node:
        return _decode_scalar(node["v"])
    if "tuple" in node:
        return tuple(decode(n, tensors, device) for n in node["tuple"])
    if "list" in node:
        return [decode(n, tensors, device) for n in node["list"]]
    if "dict" in node:
        return {k: decode(n, tensors, device) for k, n in node["dict"].items()}
    if "dtype" in node:
        return getattr(torch, node["dtype"])
    if "device" in node:
        return torch.device(device) if device is not None else torch.device(node["device"])
    return None


def tensor_names(node: Any) -> Iterator[str]:
    """The stored tensor names under a spec node, in order. Any JSON is walked (a golden's
    spec is checked with this before it is trusted)."""
    if isinstance(node, dict):
        if isinstance(node.get("t"), str):
            yield node["t"]
            return
        for child in node.values():
            yield from tensor_names(child)
    elif isinstance(node, list):
        for child in node:
            yield from tensor_names(child)


def encode_call(args: Sequence[Any], kwargs: Mapping[str, Any], record: CallRecord) -> None:
    record.spec["args"] = [encode(v, f"args.{i}", record.tensors) for i, v in enumerate(args)]
    record.spec["kwargs"] = {k: encode(v, f"kwargs.{k}", record.tensors) for k, v in kwargs.items()}


def encode_output(output: Any, record: CallRecord) -> None:
    record.spec["output"] = encode(output, "output", record.tensors)


def decode_call(
    spec: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], device: Device | None = None
) -> tuple[list[Any], dict[str, Any]]:
    args = [decode(n, tensors, device) for n in spec["args"]]
    kwargs = {k: decode(n, tensors, device) for k, n in spec["kwargs"].items()}
    return args, kwargs


def primary_output_name(spec: Mapping[str, Any]) -> str:
    """The name of the output hidden states: the first tensor in the output."""
    for name in tensor_names(spec["output"]):
        return name
    raise ValueError("the captured output holds no tensor")


def hidden_input_name(spec: Mapping[str, Any]) -> str:
    """The name of the input hidden states: the first tensor argument."""
    for node in spec["args"]:
        for name in tensor_names(node):
            return name
    for key in ("hidden_states", "hidden_state", "x", "inputs_embeds"):
        node = spec["kwargs"].get(key)
        if node and "t" in node:
            return node["t"]
    raise ValueError("the captured call has no tensor argument to take as hidden states")


def first_tensor(value: Any) -> torch.Tensor:
    """The first tensor in a (possibly nested) module output."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for item in value:
            try:
                return first_tensor(item)
            except ValueError:
                continue
    raise ValueError(f"no tensor in the module's output ({type(value).__name__})")


def replace_hidden_input(
    spec: Mapping[str, Any], tensors: dict[str, torch.Tensor], hidden: torch.Tensor
) -> dict[str, torch.Tensor]:
    """A copy of ``tensors`` whose input hidden states are ``hidden`` (for chained runs)."""
    out = dict(tensors)
    out[hidden_input_name(spec)] = hidden
    return out
