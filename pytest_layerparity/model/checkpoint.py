"""Reading a model folder's safetensors checkpoint: which shard holds each tensor, the
shards' headers, tensors mapped or read by rows without reading a whole shard, and one
decoder layer's weights loaded into a weightless skeleton through transformers' own
checkpoint-to-module conversions."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ModelError
from ..store.tensorfile import SAFETENSORS_ITEMSIZE, SAFETENSORS_TORCH_DTYPE
from .memory import give_back_memory, release_large_frees

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Checkpoint:
    """The safetensors files of a model folder and which file holds each tensor."""

    root: Path
    weight_map: dict[str, str]
    #: Each shard's header and where its data starts, read once (a layer load asks for its
    #: tensors' sizes every time).
    _headers: dict[str, tuple[dict[str, Any], int]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def open(cls, model_dir: str | Path) -> Checkpoint:
        root = Path(model_dir)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            data = json.loads(index.read_text(encoding="utf-8"))
            return cls(root, dict(data["weight_map"]))
        single = root / "model.safetensors"
        if single.is_file():
            return cls(root, dict.fromkeys(read_header_and_data_start(single)[0], single.name))
        raise ModelError(f"{root} has no model.safetensors or model.safetensors.index.json")

    def layer_keys(self, layer_path: str, index: int) -> list[str]:
        """Checkpoint keys of decoder layer ``index`` of the list at ``layer_path``: the keys
        whose names under the model's names (:meth:`model_name`) are the layer's. Those are the
        checkpoint's own names where transformers renames nothing; a checkpoint it renames as it
        loads may name the layers otherwise (EXAONE's transformer.h.N) or keep some of a
        layer's tensors outside it (Inkling-2's attn_res.mlp_queries.N, the layer's
        mlp_input.query): the loader, given those keys, renames them into the layer."""
        prefix = f"{layer_path}.{index}."
        names = self.model_names
        keys = [key for key, name in names.items() if name.startswith(prefix)]
        if keys:
            return keys
        list_name = re.escape(layer_path.rsplit(".", 1)[-1])
        pattern = re.compile(rf"(^|\.){list_name}\.{index}\.")
        return [key for key, name in names.items() if pattern.search(name)]

    @cached_property
    def renames(self) -> list[Any]:
        """The key renames (transformers' ``WeightRenaming`` rules) transformers applies to this
        checkpoint's model_type as it loads it, in order."""
        try:
            model_type = json.loads((self.root / "config.json").read_text(encoding="utf-8")).get("model_type")
            from transformers.conversion_mapping import get_checkpoint_conversion_mapping
            from transformers.core_model_loading import WeightRenaming

            mapping = get_checkpoint_conversion_mapping(model_type) or []
        except (OSError, ValueError, ImportError):
            return []
        return [rule for rule in mapping if isinstance(rule, WeightRenaming) and hasattr(rule, "rename_source_key")]

    def model_name(self, key: str) -> str:
        """``key`` under the model's name: each rename applied in turn, as the loader does
        (each rule's own ``rename_source_key``: index shifts and layer pairs included)."""
        for rule in self.renames:
            key = rule.rename_source_key(key)[0]
        return key

    @cached_property
    def model_names(self) -> dict[str, str]:
        """Every checkpoint key's name under the model's names, worked out once."""
        if not self.renames:
            return {key: key for key in self.weight_map}
        return {key: self.model_name(key) for key in self.weight_map}

    def files_for(self, keys: Iterable[str]) -> list[str]:
        return sorted({self.weight_map[key] for key in keys})

    def shard_header(self, name: str) -> tuple[dict[str, Any], int]:
        """Shard ``name``'s header (each tensor's ``shape``, ``dtype``, ``data_offsets``) and
        the file offset its data starts at; read once."""
        if name not in self._headers:
            self._headers[name] = read_header_and_data_start(self.root / name)
        return self._headers[name]

    def headers(self, keys: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Each tensor's header entry (``shape``, ``dtype``), from its shard (nothing read)."""
        keys = list(keys)
        out = {}
        for name in sorted({self.weight_map[key] for key in keys}):
            header, _ = self.shard_header(name)
            out.update({key: header[key] for key in keys if key in header})
        return out

    def nbytes(self, keys: Iterable[str]) -> dict[str, int]:
        """Each tensor's size in bytes, from the shards' headers (nothing read)."""
        return {
            key: math.prod(info["shape"]) * SAFETENSORS_ITEMSIZE.get(info["dtype"], 4)
            for key, info in self.headers(keys).items()
        }

    def load_into(self, model: torch.nn.Module, keys: Iterable[str], dtype: torch.dtype, device: str = "cpu") -> None:
        """Load these tensors into ``model`` (see :func:`load_state_into`), one conversion at a
        time, the largest first: the sources that transformers' loader turns into one
        parameter (every expert's ``w1`` and ``w3``, stacked and concatenated into
        ``gate_up_proj``) are read together, and no other group's are in memory meanwhile, so
        a layer loads in less than twice its size. The sources are maps of the shards
        (:meth:`read`); a parameter the loader takes as read is copied out of its map, so the
        loaded layer is the process's own memory and the file's pages go with the sources."""
        release_large_frees()
        keys = list(keys)
        sizes = self.nbytes(keys)
        groups = conversion_groups(model, keys)
        for group in sorted(groups, key=lambda g: -sum(sizes[k] for k in g)):
            sources = self.read(group)
            mapped = {t.untyped_storage().data_ptr() for t in sources.values() if t.numel()}
            load_state_into(model, sources, dtype, device=device)
            del sources
            _copy_out_of(model, mapped)
            give_back_memory()  # the group's sources, freed in the loader's heaps: back before the next

    def read_rows(self, key: str, rows: Iterable[tuple[int, int]]) -> list[torch.Tensor]:
        """Row ranges ``[start, stop)`` of tensor ``key`` (its first dimension), each read
        alone from its shard: an embedding's rows for the prompt's tokens, a head's rows one
        block at a time, without reading the whole tensor. The rows' bytes are read where the
        header places them: safetensors' own slices read the whole shard (its ``pread``
        backend: 579 MB resident to read 100 rows of a 200 MB shard's head) or map it (mapped
        pages counted resident: 67 MB to read 127 rows of a 65 MB embedding), measured."""
        import torch

        info, dtype, data, _ = self._located(key)
        shape = list(info["shape"])
        row_bytes = math.prod(shape[1:]) * SAFETENSORS_ITEMSIZE[info["dtype"]]
        out = []
        with open(self.root / self.weight_map[key], "rb") as handle:
            for start, stop in rows:
                buffer = bytearray((stop - start) * row_bytes)
                handle.seek(data + start * row_bytes)
                if handle.readinto(buffer) != len(buffer):
                    raise ModelError(f"{self.root / self.weight_map[key]}: {key} is cut short")
                out.append(torch.frombuffer(buffer, dtype=dtype).reshape(stop - start, *shape[1:]))
        return out

    def _located(self, key: str) -> tuple[dict[str, Any], torch.dtype, int, int]:
        """Tensor ``key``'s header entry, its torch dtype, and where its bytes start and stop
        in its shard; ModelError where the header does not describe it."""
        import torch

        name = self.weight_map[key]
        header, data_start = self.shard_header(name)
        info = header.get(key)
        if info is None or info.get("dtype") not in SAFETENSORS_TORCH_DTYPE:
            raise ModelError(f"{self.root / name}: no readable tensor {key!r} in its header")
        start, stop = (data_start + offset for offset in info["data_offsets"])
        return info, getattr(torch, SAFETENSORS_TORCH_DTYPE[info["dtype"]]), start, stop

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """Just these tensors, each mapped from its shard on its own (private: a write copies
        the page). Their pages are the file's, read as the loader touches them and the
        kernel's to take back, not memory the process allocated; each mapping goes with its
        tensor. Read into memory of their own instead, transformers' loader held a layer's
        sources beside the stacked experts it makes of them: about twice the layer, measured
        (a whole shard mapped at once stays resident while any tensor read from it lives).
        A caller that keeps a tensor copies it (:meth:`load_into` does)."""
        import mmap

        import torch

        by_file: dict[str, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.weight_map[key], []).append(key)
        out = {}
        for name, file_keys in sorted(by_file.items()):
            with open(self.root / name, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                for key in file_keys:
                    info, dtype, start, stop = self._located(key)
                    count = (stop - start) // SAFETENSORS_ITEMSIZE[info["dtype"]]
                    if count != math.prod(info["shape"]):
                        raise ModelError(f"{self.root / name}: {key}'s offsets do not hold its shape {info['shape']}")
                    if count == 0:
                        out[key] = torch.empty(info["shape"], dtype=dtype)
                        continue
                    if size < stop:
                        raise ModelError(f"{self.root / name}: {key} is cut short")
                    base = start - start % mmap.ALLOCATIONGRANULARITY
                    mapped = mmap.mmap(handle.fileno(), stop - base, access=mmap.ACCESS_COPY, offset=base)
                    tensor = torch.frombuffer(mapped, dtype=dtype, count=count, offset=start - base)
                    out[key] = tensor.reshape(info["shape"])
        return out


def read_header_and_data_start(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (its ``__metadata__`` left out) and the offset its tensors'
    data starts at (their ``data_offsets`` count from there)."""
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        if not isinstance(header, dict):
            raise ValueError("its header is not a table of tensors")
    except (struct.error, ValueError) as exc:  # json's and unicode's errors are ValueErrors
        raise ModelError(f"{path}: not a readable safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    return header, 8 + length


def _copy_out_of(model: torch.nn.Module, storages: set[int]) -> None:
    """Each CPU parameter and buffer of ``model`` whose memory is one of ``storages`` (the
    data pointers of mapped sources) replaced by a copy of its own."""
    import torch

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None or tensor.device.type != "cpu":
                    continue
                if tensor.untyped_storage().data_ptr() in storages:
                    own = tensor.detach().clone()
                    is_param = isinstance(tensor, torch.nn.Parameter)
                    table[name] = torch.nn.Parameter(own, requires_grad=tensor.requires_grad) if is_param else own


def conversion_groups(model: torch.nn.Module, keys: list[str]) -> list[list[str]]:
    """``keys`` split by the transformers conversion that makes a parameter of several of them
    (one group per converter and module: ``layers.3.mlp.experts.*.w1/w3`` → ``gate_up_proj``);
    the keys no such conversion takes form one more group."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return [keys]
    return [group for _, group in split_by_conversion(get_model_conversion_mapping(model), keys)]


def split_by_conversion(mapping: list[Any], keys: list[str]) -> list[tuple[Any, list[str]]]:
    """``keys`` split by the converter of ``mapping`` (transformers' weight transforms) that
    takes them, one group per converter and module, each with its converter; the keys no
    converter takes form one group whose converter is None."""
    patterns = []
    if mapping:  # a mapping comes from a transformers that has its loader's converters
        from transformers.core_model_loading import WeightConverter
    for converter in mapping:
        if isinstance(converter, WeightConverter) and len(converter.source_patterns) > 0:
            for source in converter.source_patterns:
                text = re.escape(source).replace(r"\*", r"\d+")
                patterns.append((converter, re.compile(text)))
    groups: dict[tuple, tuple[Any, list[str]]] = {}
    for key in keys:
        for converter, pattern in patterns:
            found = pattern.search(key)
            if found:
                groups.setdefault((id(converter), key[: found.start()]), (converter, []))[1].append(key)
                break
        else:
            groups.setdefault((), (None, []))[1].append(key)
    return list(groups.values())


def load_state_into(
    model: torch.nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype, device: str = "cpu"
) -> None:
    """Load a partial checkpoint state dict into a (meta) model, applying transformers'
    own checkpoint-to-module conversions (renames, fused experts) where the model has them."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig
    except ImportError:  # an older transformers: names map one to one
        model.load_state_dict(
            {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in state.items()},
            strict=False,
            assign=True,
        )
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    load_config = LoadStateDictConfig(
        weight_mapping=get_model_conversion_mapping(model), dtype=dtype, device_map={"": device}
    )
    convert_and_load_state_dict_in_model(model, dict(state), load_config)


def meta_tensors(module: torch.nn.Module) -> list[str]:
    names = [n for n, p in module.named_parameters() if p.device.type == "meta"]
    names += [n for n, b in module.named_buffers() if b.device.type == "meta"]
    return names


def load_layer(
    skeleton: torch.nn.Module, checkpoint: Checkpoint, layer_path: str, index: int, dtype: torch.dtype
) -> torch.nn.Module:
    """Materialise decoder layer ``index`` of ``skeleton`` on the CPU from the checkpoint,
    reading only that layer's tensors. Returns the layer module."""
    layers = skeleton.get_submodule(layer_path)
    keys = checkpoint.layer_keys(layer_path, index)
    if not keys:
        example = next(iter(checkpoint.weight_map), "none")
        raise ModelError(
            f"the checkpoint in {checkpoint.root} has no tensors for layer {index} of {layer_path} "
            f"(a key there: {example!r})"
        )
    pristine = copy.deepcopy(layers[index])
    try:
        checkpoint.load_into(skeleton, keys, dtype)
        layer = layers[index]
    finally:
        layers[index] = pristine  # the skeleton stays weightless; the caller owns the layer
    missing = meta_tensors(layer)
    if missing:
        raise ModelError(f"layer {index}: these tensors were not found in the checkpoint: {', '.join(missing[:10])}")
    return layer
