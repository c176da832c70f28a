"""One model folder as the stages use it (:class:`ModelSource`): its config, checkpoint,
decoder-layer list and per-layer builds."""

from __future__ import annotations

import copy
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .build import (
    ModelError,
    build_skeleton,
    capped_attention,
    config_sha256,
    find_layer_list,
    hidden_size_from_config,
    layer_count_from_config,
    load_hf_config,
    model_class_for,
    module_lists,
    read_config_json,
)
from .checkpoint import Checkpoint, load_layer
from .fingerprint import layer_fingerprint

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel


def model_dir_of(model: str | None) -> Path:
    """The model folder of ``--model``, or ModelError saying how to give one."""
    if not model:
        raise ModelError(
            "no model given: pass --model DIR (a HuggingFace model folder) or set layerparity_model in your pytest ini"
        )
    return Path(model)


class ModelSource:
    """One model folder: its config, checkpoint, decoder-layer list and per-layer builds.

    ``attn_implementation`` applies to the reference model (None: the library's default, but
    eager for the reference and the target's layers alike where attention logits are
    soft-capped: :func:`.build.capped_attention`); ``experts_implementation`` to the layers
    built for the target (``layer_config``). Skeletons are weightless (meta device) and built
    once per dtype.
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
        self._digests: dict[tuple[int, torch.dtype, str], str | None] = {}  # a layer's weights read once

    @cached_property
    def config_json(self) -> dict[str, Any]:
        return read_config_json(self.model_dir)

    @cached_property
    def hf_config(self) -> PretrainedConfig:
        config = load_hf_config(self.model_dir, self.trust_remote_code)
        implementation = self.attn_implementation or capped_attention(config)
        if implementation:
            config._attn_implementation = implementation
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
                f"with -o layerparity_layer_module=PATH or that ini key (module lists in this model: "
                f"{', '.join(module_lists(skeleton))})"
            )
        return count

    @cached_property
    def checkpoint(self) -> Checkpoint:
        return Checkpoint.open(self.model_dir)

    def load_layer(self, index: int, dtype: torch.dtype) -> torch.nn.Module:
        """Decoder layer ``index`` with its weights, on the CPU in ``dtype``, in eval mode."""
        skeleton = self.skeleton(dtype)
        return load_layer(skeleton, self.checkpoint, self.layer_list[0], index, dtype).eval()

    def weights_fingerprint(self, index: int, dtype: torch.dtype, layer_path: str | None = None) -> str | None:
        """The digest of layer ``index``'s checkpoint tensors in ``dtype`` (see
        :mod:`.fingerprint`; ``layer_path``: the layer list's path, where a store recorded it);
        None where there is nothing to digest: no safetensors checkpoint, no tensors of its own.
        Digested once per process (an extraction's check of the store and its golden ask both)."""
        try:
            checkpoint = self.checkpoint
        except ModelError:
            return None
        key = (index, dtype, layer_path or self.layer_list[0])
        if key not in self._digests:
            self._digests[key] = layer_fingerprint(checkpoint, key[2], index, dtype)
        return self._digests[key]

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
