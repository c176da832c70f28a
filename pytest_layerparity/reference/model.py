"""Model-side helpers: read a checkpoint's config, find its decoder-layer list, build a
weightless skeleton, and load one layer's weights from the safetensors shards.

Nothing here is specific to one architecture: the layer list is found by name among the
common HF layouts, or by the model's own ``nn.ModuleList`` whose length is the configured
layer count, or named by the user (``--layer-module``).
"""

from __future__ import annotations

import copy
import hashlib
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

from ..store.tensorfile import SAFETENSORS_ITEMSIZE, SAFETENSORS_TORCH_DTYPE

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

# Common places of the decoder-layer list, tried in order.
LAYER_LIST_CANDIDATES = (
    "model.layers",
    "model.language_model.layers",
    "language_model.model.layers",
    "model.decoder.layers",
    "transformer.h",
    "transformer.layers",
    "transformer.blocks",
    "gpt_neox.layers",
    "model.transformer.h",
    "layers",
    "encoder.layer",
    "bert.encoder.layer",
    "h",
)
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "torch_dtype", "dtype")


class ModelError(Exception):
    """The model folder cannot be used as given; the message says what to fix."""


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelError(
            f"{model_dir} has no config.json; --model must be a HuggingFace model folder "
            "(config.json and safetensors weights)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelError(f"{path}: not a JSON object")
    return data


def config_sha256(config: dict[str, Any]) -> str:
    """A hash of the model's architecture config, ignoring fields that change with tooling."""
    stable = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()


def layer_count_from_config(config: dict[str, Any]) -> int | None:
    for scope in (config, config.get("text_config") or {}):
        for key in _LAYER_COUNT_KEYS:
            value = scope.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


def hidden_size_from_config(config: dict[str, Any]) -> int | None:
    for scope in (config, config.get("text_config") or {}):
        for key in ("hidden_size", "n_embd", "d_model"):
            value = scope.get(key)
            if isinstance(value, int):
                return value
    return None


#: The goldens' dtype when the checkpoint's config names none.
FALLBACK_DTYPE = "float32"


def checkpoint_dtype(config: dict[str, Any]) -> str:
    """The dtype the checkpoint was saved in, as transformers' ``dtype="auto"`` reads it
    (``dtype``, formerly ``torch_dtype``, in config.json; a multimodal config's text part),
    else float32."""
    for source in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            value = source.get(key) if isinstance(source, dict) else None
            if isinstance(value, str):
                name = value.removeprefix("torch.")
                if name in ("bfloat16", "float16", "float32"):
                    return name
    return FALLBACK_DTYPE


def torch_dtype(name: str):
    import torch

    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ModelError(f"unknown dtype {name!r}")
    return value


def transformers_4_names(config: dict[str, Any]) -> dict[str, Any]:
    """The fields transformers 4 reads under other names than the ones transformers 5 wrote
    to ``config``: ``rope_theta`` and ``rope_scaling`` (in 5: ``rope_parameters``),
    ``num_experts`` / ``num_local_experts`` (each architecture reads one), ``torch_dtype``
    (in 5: ``dtype``). Only fields ``config`` lacks are returned."""
    out: dict[str, Any] = {}
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):
        if config.get("rope_theta") is None and "rope_theta" in rope:
            out["rope_theta"] = rope["rope_theta"]
        if config.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        if config.get("partial_rotary_factor") is None and "partial_rotary_factor" in rope:
            out["partial_rotary_factor"] = rope["partial_rotary_factor"]
    for a, b in (("num_local_experts", "num_experts"), ("dtype", "torch_dtype")):
        if config.get(b) is None and config.get(a) is not None:
            out[b] = config[a]
        if config.get(a) is None and config.get(b) is not None:
            out[a] = config[b]
    return out


def load_hf_config(model_dir: str | Path, trust_remote_code: bool = False):
    """The checkpoint's config; under transformers 4, with the fields transformers 5 renamed
    read under their old names too (a store extracted with 5 is tested under 4)."""
    import transformers
    from transformers import AutoConfig

    overrides = {}
    if int(transformers.__version__.split(".", 1)[0]) < 5:
        overrides = transformers_4_names(read_config_json(model_dir))
    return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code, **overrides)


def model_class_for(hf_config: PretrainedConfig, trust_remote_code: bool = False) -> type[Any]:
    """The class the checkpoint was saved from (config.architectures), else the causal-LM
    class of its model type, else the base model: so module names match checkpoint keys."""
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for name in getattr(hf_config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    if getattr(hf_config, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or trust_remote_code:
        return AutoModelForCausalLM
    return AutoModel


def build_skeleton(hf_config: PretrainedConfig, dtype: torch.dtype, trust_remote_code: bool = False) -> PreTrainedModel:
    """The model with every parameter on the meta device (no weight memory); real buffers."""
    from accelerate import init_empty_weights

    cls = model_class_for(hf_config, trust_remote_code)
    with init_empty_weights(include_buffers=False):
        if cls.__name__.startswith("Auto"):
            model = cls.from_config(hf_config, dtype=dtype, trust_remote_code=trust_remote_code)
        else:
            model = cls._from_config(own_config(cls, hf_config), dtype=dtype)
    return model.eval()


def own_config(cls: type[Any], hf_config: PretrainedConfig) -> PretrainedConfig:
    """The config ``cls`` is built from: a composite config's text part where the class takes
    that (Emu3ForCausalLM takes Emu3TextConfig; its checkpoints save the composite Emu3Config,
    which from_pretrained without a config reads the same way)."""
    wanted = getattr(cls, "config_class", None)
    if not isinstance(wanted, type) or isinstance(hf_config, wanted):
        return hf_config
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else None
    return text if isinstance(text, wanted) else hf_config


def eager_experts_skeleton(
    hf_config: PretrainedConfig, dtype: torch.dtype, trust_remote_code: bool = False
) -> PreTrainedModel:
    """:func:`build_skeleton` with the experts computed one at a time (eager), as the
    reference's wider evaluations run a layer: the precision floor (grouped kernels have no
    float64) and the envelope's perturbed runs (a grouped kernel's wider evaluation would
    widen every expert's weights at once)."""
    config = copy.deepcopy(hf_config)
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"
    return build_skeleton(config, dtype, trust_remote_code)


def get_submodule(model: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def find_layer_list(
    model: torch.nn.Module, num_layers: int | None, layer_module: str | None = None
) -> tuple[str, torch.nn.ModuleList]:
    """Return ``(dotted path, ModuleList)`` of the decoder layers."""
    import torch

    if layer_module:
        found = get_submodule(model, layer_module)
        if not isinstance(found, (torch.nn.ModuleList, torch.nn.Sequential)):
            raise ModelError(
                f"--layer-module {layer_module!r} is not a list of layers in {type(model).__name__}; "
                f"module lists in this model: {', '.join(module_lists(model)) or 'none'}"
            )
        return layer_module, found
    for path in LAYER_LIST_CANDIDATES:
        found = get_submodule(model, path)
        if isinstance(found, torch.nn.ModuleList) and len(found) > 0:
            return path, found
    lists = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, torch.nn.ModuleList)]
    matching = [(name, mod) for name, mod in lists if num_layers is None or len(mod) == num_layers]
    if len(matching) >= 1:
        return matching[0]
    raise ModelError(
        f"cannot find the decoder-layer list of {type(model).__name__}; name it with "
        f"--layer-module (module lists in this model: {', '.join(module_lists(model)) or 'none'})"
    )


def module_lists(model: torch.nn.Module) -> list[str]:
    import torch

    return [f"{name} ({len(mod)})" for name, mod in model.named_modules() if isinstance(mod, torch.nn.ModuleList)]


# -- checkpoint access ---------------------------------------------------------------


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


def checkpoint_conversions(source: ModelSource) -> list[Any]:
    """The weight transforms transformers' loader applies to this checkpoint, found as it
    finds them (the model class's name, then its model type) without building the model:
    none for a model whose code comes with the checkpoint, or where transformers has none."""
    if source.trust_remote_code:
        return []
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        name = model_class_for(source.hf_config).__name__
        return (
            get_checkpoint_conversion_mapping(name)
            or get_checkpoint_conversion_mapping(getattr(source.hf_config, "model_type", None))
            or []
        )
    except Exception:  # an older transformers, or a config it cannot read: names map one to one
        return []


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


_LARGE_FREES_RELEASED = False


def release_large_frees() -> None:
    """Have glibc give freed blocks of 1 MiB and more back to the system at once (a fixed
    ``M_MMAP_THRESHOLD``). By default the threshold follows the largest block freed, up to
    32 MiB, after which freed tensors stay in the heap of the thread that allocated them,
    where other threads do not reuse them: a layer loaded by transformers' loader threads
    would leave its sources' memory resident (measured: 118 MB after loading a 54 MB layer,
    58 MB with this). Once per process; Linux only."""
    global _LARGE_FREES_RELEASED
    import sys

    if _LARGE_FREES_RELEASED or not sys.platform.startswith("linux"):
        return
    _LARGE_FREES_RELEASED = True
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


#: Entries oneDNN's primitive cache and ideep's computation cache keep during a reference run
#: (the libraries' default is 1024 each). A 16-bit matmul on the CPU compiles a kernel per
#: shape and both libraries keep it; a mixture of experts gives each expert a new number of
#: tokens, so every layer adds shapes: measured 4 MB a layer at seq 512, up to about 70 MB
#: before the default capacities fill, whatever the layers' size.
KERNEL_CACHE_ENTRIES = 16
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_reference_memory() -> None:
    """What a reference run (extraction, or verifying a store) sets at start-up, before its
    first matmul, so that its memory follows the layer and not the run's length: large
    frees given back at once (:func:`release_large_frees`, before the heap grows), and the
    CPU matmul libraries' kernel caches held to ``KERNEL_CACHE_ENTRIES`` (their sizes are
    read from the environment when each cache is first used; a value set by the user is
    kept)."""
    release_large_frees()
    for name in KERNEL_CACHE_VARIABLES:
        os.environ.setdefault(name, str(KERNEL_CACHE_ENTRIES))


def give_back_memory() -> None:
    """Return freed heap memory to the system (glibc keeps it otherwise, so peak RSS would
    grow with each layer loaded and freed)."""
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass


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


# -- one model folder, as the stages use it -------------------------------------------------


def model_dir_of(model: str | None) -> Path:
    """The model folder of ``--model``, or ModelError saying how to give one."""
    if not model:
        raise ModelError(
            "no model given: pass --model DIR (a HuggingFace model folder) or set layerparity_model in your pytest ini"
        )
    return Path(model)


class ModelSource:
    """One model folder: its config, checkpoint, decoder-layer list and per-layer builds.

    ``attn_implementation`` applies to the reference model; ``experts_implementation`` to
    the layers built for the target (``layer_config``). Skeletons are weightless (meta
    device) and built once per dtype.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        layer_module: str | None = None,
        trust_remote_code: bool = False,
        attn_implementation: str | None = None,
        experts_implementation: str | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.layer_module = layer_module
        self.trust_remote_code = trust_remote_code
        self.attn_implementation = attn_implementation
        self.experts_implementation = experts_implementation
        self._skeletons: dict[torch.dtype, PreTrainedModel] = {}

    @cached_property
    def config_json(self) -> dict[str, Any]:
        return read_config_json(self.model_dir)

    @cached_property
    def hf_config(self) -> PretrainedConfig:
        config = load_hf_config(self.model_dir, self.trust_remote_code)
        if self.attn_implementation:
            config._attn_implementation = self.attn_implementation
        return config

    @cached_property
    def layer_config(self) -> PretrainedConfig:
        """The config the layers under test are built from (the experts implementation the
        target needs)."""
        config = copy.deepcopy(self.hf_config)
        if self.experts_implementation and hasattr(config, "_experts_implementation"):
            config._experts_implementation = self.experts_implementation
        return config

    def skeleton(self, dtype: torch.dtype) -> PreTrainedModel:
        """The weightless model in ``dtype``, built from ``layer_config`` (once per dtype)."""
        if dtype not in self._skeletons:
            self._skeletons[dtype] = build_skeleton(self.layer_config, dtype, self.trust_remote_code)
        return self._skeletons[dtype]

    @cached_property
    def layer_list(self) -> tuple[str, torch.nn.ModuleList]:
        """(dotted path, ModuleList) of the decoder layers; found on a skeleton already built
        when there is one (the path does not depend on the dtype)."""
        import torch

        skeleton = next(iter(self._skeletons.values()), None) or self.skeleton(torch.float32)
        return find_layer_list(skeleton, layer_count_from_config(self.config_json), self.layer_module)

    @cached_property
    def layer_owner(self) -> torch.nn.Module:
        """The module the decoder-layer list belongs to (whose forward runs the layers), of a
        skeleton."""
        import torch

        skeleton = next(iter(self._skeletons.values()), None) or self.skeleton(torch.float32)
        return skeleton.get_submodule(self.layer_list[0].rpartition(".")[0])

    @cached_property
    def cache_argument(self) -> str | None:
        """The name the model's decoder layers take their KV cache by in the installed
        transformers (``cache`` from 5.24, ``past_key_values`` before): a call is replayed
        under it where the callee's own signature does not say (a port that takes ``**kwargs``)."""
        from ..store.callspec import cache_argument

        return cache_argument(self.layer_list[1][0])

    @cached_property
    def num_layers(self) -> int:
        count = layer_count_from_config(self.config_json)
        if self.layer_module or count is None:
            return len(self.layer_list[1])
        path, found = self.layer_list
        parsed = getattr(self.hf_config, "num_hidden_layers", None)  # Dory's config.json counts half-layers
        if len(found) != count and len(found) == parsed:
            return len(found)
        if len(found) != count:
            skeleton = next(iter(self._skeletons.values()))
            raise ModelError(
                f"config.json says {count} decoder layers, and {type(found).__name__} {path!r} of the model holds "
                f"{len(found)}: its layer modules are not one per layer (a model that runs a module more than once, "
                "or keeps its layers elsewhere), so a layer's calls cannot be told apart; name the list of layers "
                f"with --layer-module (module lists in this model: {', '.join(module_lists(skeleton))})"
            )
        return count

    @cached_property
    def checkpoint(self) -> Checkpoint:
        return Checkpoint.open(self.model_dir)

    def load_layer(self, index: int, dtype: torch.dtype) -> torch.nn.Module:
        """Decoder layer ``index`` with its weights, on the CPU in ``dtype``, in eval mode."""
        skeleton = self.skeleton(dtype)
        return load_layer(skeleton, self.checkpoint, self.layer_list[0], index, dtype).eval()

    @property
    def top_k(self) -> int | None:
        """Experts per token of a mixture-of-experts model, else None."""
        cfg = self.config_json
        for scope in (cfg, cfg.get("text_config") or {}):
            for name in ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts"):
                value = scope.get(name)
                if isinstance(value, int):
                    return value
        return None

    @property
    def vocab_size(self) -> int:
        cfg = self.config_json
        return int(cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size"))

    def identity(self) -> dict[str, Any]:
        """What ties a golden store to this model (compared on every load)."""
        return {
            "config_sha256": config_sha256(self.config_json),
            "num_layers": self.num_layers,
            "hidden_size": hidden_size_from_config(self.config_json),
            "model_type": self.config_json.get("model_type"),
        }
