"""Layer streaming: run a model whose weights never all sit in memory.

The model is built on the meta device (no weight memory). Each decoder layer is a unit
whose weights are read from the safetensors shards (only that layer's tensors, through the
index's weight_map) when the model's own forward reaches it, and given back as soon as it
returns. The other modules that hold weights (embeddings, final norm, head) are units too,
loaded just before they run; weights that cannot be told apart by module (tied or renamed
ones) are loaded once up front. Peak memory: about the largest unit plus activations, flat in
the number of layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    Device = str | torch.device

from . import model as modeling


@dataclass
class Unit:
    path: str
    module: torch.nn.Module
    keys: list[str]
    resident: bool = False


@dataclass
class StreamPlan:
    units: list[Unit]
    resident_keys: list[str] = field(default_factory=list)

    @property
    def resident(self) -> list[Unit]:
        return [u for u in self.units if u.resident]


def _has_direct_weights(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def plan_units(model: torch.nn.Module, checkpoint: modeling.Checkpoint, layer_path: str) -> StreamPlan:
    """Split the model into streamable units: each decoder layer, and each other module
    that directly holds parameters (outside the layers)."""
    layers = model.get_submodule(layer_path)
    units: list[Unit] = []
    claimed: set[str] = set()
    for index, layer in enumerate(layers):
        keys = checkpoint.layer_keys(layer_path, index)
        units.append(Unit(f"{layer_path}.{index}", layer, keys))
        claimed.update(keys)
    for name, module in model.named_modules():
        if not name or name == layer_path or name.startswith(layer_path + "."):
            continue
        if _has_direct_weights(module):
            keys = [k for k in checkpoint.weight_map if k.startswith(name + ".") and k not in claimed]
            units.append(Unit(name, module, keys))
            claimed.update(keys)
    rest = [k for k in checkpoint.weight_map if k not in claimed]
    plan = StreamPlan(units, rest)
    tied = set()
    for pair in _tied_pairs(model):
        tied.update(pair)
    for unit in units:
        if not unit.keys or any(
            unit.path == t or unit.path.startswith(t + ".") or t.startswith(unit.path + ".") for t in tied
        ):
            unit.resident = not unit.path.startswith(layer_path + ".")
    return plan


def _tied_pairs(model: torch.nn.Module) -> list[tuple[str, str]]:
    keys = getattr(model, "_tied_weights_keys", None) or {}
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return []
    if isinstance(keys, dict):
        return [(a.rsplit(".", 1)[0], b.rsplit(".", 1)[0]) for a, b in keys.items()]
    return []


def _load(
    model: torch.nn.Module, checkpoint: modeling.Checkpoint, keys: list[str], dtype: torch.dtype, device: Device
) -> None:
    if keys:
        checkpoint.load_into(model, keys, dtype, device=str(device))


@contextmanager
def streamed(
    model: torch.nn.Module,
    checkpoint: modeling.Checkpoint,
    layer_path: str,
    dtype: torch.dtype,
    device: Device,
    on_unit: Callable[[Unit, torch.nn.Module], None] | None = None,
) -> Iterator[StreamPlan]:
    """While the block runs the model's forward, each unit's weights are loaded onto
    ``device`` when it is called and released when it returns. ``on_unit(unit, module)``
    is called right after a unit is loaded (for a dtype audit, say). Hooks are always removed."""
    plan = plan_units(model, checkpoint, layer_path)
    resident_keys = plan.resident_keys + [k for u in plan.resident for k in u.keys]
    _load(model, checkpoint, resident_keys, dtype, device)
    for unit in plan.resident:
        unit.module.to(device)
    _move_buffers(model, device)
    handles = []

    def pre(unit: Unit):
        def load(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            _load(model, checkpoint, unit.keys, dtype, device)
            module.to(device)
            if on_unit is not None:
                on_unit(unit, module)

        return load

    def post(unit: Unit):
        def release(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            _release(module)
            modeling.give_back_memory()

        return release

    try:
        for unit in plan.units:
            if unit.resident:
                continue
            handles.append(unit.module.register_forward_pre_hook(pre(unit), with_kwargs=True))
            handles.append(unit.module.register_forward_hook(post(unit), with_kwargs=True))
        yield plan
    finally:
        for handle in handles:
            handle.remove()


def _move_buffers(model: torch.nn.Module, device: Device) -> None:
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None and buffer.device.type != "meta":
                module._buffers[name] = buffer.to(device)


def _release(module: torch.nn.Module) -> None:
    """Give a unit's weights back: parameters and persistent buffers go to meta."""
    import torch

    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            sub._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        persistent = [n for n in sub._buffers if n not in sub._non_persistent_buffers_set]
        for name in persistent:
            if sub._buffers[name] is not None:
                sub._buffers[name] = sub._buffers[name].to("meta")
