"""Layer streaming: run a model whose weights never all sit in memory.

The model is built on the meta device (no weight memory). Each decoder layer is a unit
whose weights are read from the safetensors shards (only that layer's tensors, through the
index's weight_map) when the model's own forward reaches it, and given back as soon as it
returns. The other modules that hold weights (embeddings, final norm, head) are units too,
loaded just before they run; weights that cannot be told apart by module (tied or renamed
ones) are loaded once up front. An embedding reads only the rows of the tokens it is called
with, and a linear module outside the layers (the head) reads its weight one block of rows at
a time, the block and its outputs at most half the largest layer each (``ROW_BLOCK_FRACTION``):
neither is ever read whole, however large the vocabulary. Peak memory: about the largest
layer plus activations, flat in the number of layers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    Device = str | torch.device

from .checkpoint import Checkpoint
from .memory import give_back_memory

#: A head read by blocks of rows reads at most this fraction of the largest decoder layer at once.
ROW_BLOCK_FRACTION = 0.5


@dataclass
class Unit:
    path: str
    module: torch.nn.Module
    keys: list[str]
    resident: bool = False
    layer: bool = False  # a decoder layer (read whole, when it is called)

    def by_rows(self) -> str | None:
        """How this unit reads its weight by rows instead of whole: ``"embedding"`` (the rows
        of the tokens it is called with), ``"linear"`` (blocks of output rows), or None (read
        whole: a decoder layer, a resident unit, a module of another kind or whose tensors do
        not map one to one onto its parameters)."""
        import torch

        if self.resident or self.layer:
            return None
        weight = f"{self.path}.weight"
        if isinstance(self.module, torch.nn.Embedding) and self.keys == [weight]:
            return "embedding"
        plain_linear = type(self.module) is torch.nn.Linear  # a subclass may compute otherwise
        if plain_linear and weight in self.keys and set(self.keys) <= {weight, f"{self.path}.bias"}:
            return "linear"
        return None


@dataclass
class StreamPlan:
    units: list[Unit]
    resident_keys: list[str] = field(default_factory=list)

    @property
    def resident(self) -> list[Unit]:
        return [u for u in self.units if u.resident]


def _has_direct_weights(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def plan_units(model: torch.nn.Module, checkpoint: Checkpoint, layer_path: str) -> StreamPlan:
    """Split the model into streamable units: each decoder layer, and each other module
    that directly holds parameters (outside the layers)."""
    layers = model.get_submodule(layer_path)
    units: list[Unit] = []
    claimed: set[str] = set()
    for index, layer in enumerate(layers):
        keys = checkpoint.layer_keys(layer_path, index)
        units.append(Unit(f"{layer_path}.{index}", layer, keys, layer=True))
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


def _load(model: torch.nn.Module, checkpoint: Checkpoint, keys: list[str], dtype: torch.dtype, device: Device) -> None:
    if keys:
        checkpoint.load_into(model, keys, dtype, device=str(device))


@contextmanager
def streamed(
    model: torch.nn.Module,
    checkpoint: Checkpoint,
    layer_path: str,
    dtype: torch.dtype,
    device: Device,
    on_unit: Callable[[Unit, torch.nn.Module], None] | None = None,
    empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
) -> Iterator[StreamPlan]:
    """While the block runs the model's forward, each unit's weights are loaded onto
    ``device`` when it is called and released when it returns. ``on_unit(unit, module)``
    is called right after a unit is loaded (for a dtype audit, say). ``empty(shape, dtype)``
    makes the result a head read by rows writes its blocks into, where it is on the CPU
    (extraction: a file-backed map, ``spill.mapped_empty``). Hooks are always removed."""
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
            _put_back(module)
            give_back_memory()

        return release

    def rows(unit: Unit):
        def load(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            tokens = args[0] if args else kwargs["input"]
            where = _embedding_rows(module, checkpoint, unit.keys[0], tokens, dtype, device)
            if on_unit is not None:
                on_unit(unit, module)
            return ((where, *args[1:]), kwargs) if args else (args, {**kwargs, "input": where})

        return load

    blocked = []
    try:
        block = int(ROW_BLOCK_FRACTION * _layer_elements(checkpoint, plan))
        for unit in plan.units:
            if unit.resident:
                continue
            kind = unit.by_rows()
            if kind == "linear":
                unit.module.forward = functools.partial(
                    _blocked_linear, unit, checkpoint, dtype, device, block, on_unit, empty
                )
                blocked.append(unit.module)
                continue
            loader = rows(unit) if kind == "embedding" else pre(unit)
            handles.append(unit.module.register_forward_pre_hook(loader, with_kwargs=True))
            handles.append(unit.module.register_forward_hook(post(unit), with_kwargs=True))
        yield plan
    finally:
        for handle in handles:
            handle.remove()
        for module in blocked:
            del module.forward


def _layer_elements(checkpoint: Checkpoint, plan: StreamPlan) -> int:
    """The largest decoder layer's number of elements, from the checkpoint's headers."""
    layers = [u for u in plan.units if u.layer]
    headers = checkpoint.headers([k for u in layers for k in u.keys])
    return max((sum(math.prod(headers[k]["shape"]) for k in u.keys if k in headers) for u in layers), default=0)


def _embedding_rows(
    module: torch.nn.Module, checkpoint: Checkpoint, key: str, tokens: torch.Tensor, dtype, device
) -> torch.Tensor:
    """Give the embedding ``module`` the rows of ``tokens`` alone (read from the checkpoint,
    in ``dtype`` on ``device``); returns each token's row among them. The
    padding index is set aside for the call: the rows are renumbered, and it changes no value."""
    import torch

    wanted, where = torch.unique(tokens.detach().cpu(), sorted=True, return_inverse=True)
    parts = checkpoint.read_rows(key, _runs(wanted.tolist()))
    _set_aside(module)
    weight = torch.cat(parts) if len(parts) > 1 else parts[0]
    module._parameters["weight"] = torch.nn.Parameter(weight.to(device, dtype), requires_grad=False)
    module.padding_idx = None
    return where.to(tokens.device)


def _set_aside(module: torch.nn.Module) -> None:
    """Keep the module's (meta) weight and padding index, to put back once its call returns
    (:func:`_put_back`): the rows it is given for the call are not its whole weight."""
    if "_streamed" not in module.__dict__:
        module.__dict__["_streamed"] = (module._parameters["weight"], getattr(module, "padding_idx", None))


def _put_back(module: torch.nn.Module) -> None:
    kept = module.__dict__.pop("_streamed", None)
    if kept is not None:
        module._parameters["weight"] = kept[0]
        if hasattr(module, "padding_idx"):
            module.padding_idx = kept[1]


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct ids as ranges [start, stop) of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _blocked_linear(
    unit: Unit,
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    device: Device,
    block_elements: int,
    on_unit: Callable[[Unit, torch.nn.Module], None] | None,
    empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None,
    x: torch.Tensor,
) -> torch.Tensor:
    """``unit``'s linear module applied to ``x`` with its weight read a block of output rows
    at a time (the block, and its outputs for every token of ``x``, at most ``block_elements``
    elements each, and at least one row), each block's outputs written into the result
    (made by ``empty`` on the CPU, when given): every output is the same dot product as with
    the whole weight."""
    import torch

    module = unit.module
    key, bias_key = f"{unit.path}.weight", f"{unit.path}.bias"
    out_features, in_features = checkpoint.headers([key])[key]["shape"]
    tokens = max(x.numel() // max(in_features, 1), 1)
    step = max(1, block_elements // max(in_features, tokens))  # the block and its outputs: half a layer each at most
    bias = checkpoint.read([bias_key])[bias_key].to(device, dtype) if bias_key in unit.keys else None
    out = None
    _set_aside(module)
    try:
        for start in range(0, out_features, step):
            stop = min(start + step, out_features)
            (rows,) = checkpoint.read_rows(key, [(start, stop)])
            module._parameters["weight"] = torch.nn.Parameter(rows.to(device, dtype), requires_grad=False)
            del rows
            if start == 0 and on_unit is not None:
                on_unit(unit, module)
            part = torch.nn.functional.linear(x, module.weight, None if bias is None else bias[start:stop])
            if out is None:
                shape = (*part.shape[:-1], out_features)
                cpu = empty is not None and part.device.type == "cpu"
                out = empty(shape, part.dtype) if cpu else part.new_empty(shape)
            out[..., start:stop] = part
            del part
    finally:
        _release(module)
        _put_back(module)
        give_back_memory()
    return out


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
