"""What the reference side can record of an architecture, decided from its config before any
work is done: a refusal names the reason and the way round it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..store.callspec import UnstorableCache, check_storable
from .model import ModelError

if TYPE_CHECKING:
    from .model import ModelSource


def check_decode_cache(model: ModelSource, layers: list[int], decode_steps: int) -> None:
    """Refuse decode steps where a selected layer's KV-cache entry, as transformers makes it for
    this config, holds state beyond keys and values (a decode-step golden stores those alone).
    A config transformers' cache cannot read is left to the recording, which checks each entry."""
    if not decode_steps:
        return
    from transformers.cache_utils import DynamicCache

    modeling_module(model)  # registers the cache entries the architecture defines for its layer types
    try:
        entries = DynamicCache(config=model.hf_config).layers
    except (AttributeError, KeyError, TypeError, ValueError):
        return
    for index in layers:
        if index < len(entries):
            try:
                check_storable(entries[index], index)
            except UnstorableCache as exc:
                raise ModelError(f"--decode-steps {decode_steps}: {exc}") from None


def modeling_module(model: ModelSource) -> None:
    """Import the architecture's modeling module (a cache entry class it defines registers
    itself for its layer type when the module is imported)."""
    from transformers import AutoModelForCausalLM

    try:
        AutoModelForCausalLM._model_mapping[type(model.hf_config)]
    except (KeyError, ImportError, AttributeError, ValueError):
        pass  # not a causal LM transformers maps: its remote code is imported when the model is made


def check_checkpoint_names(model: ModelSource, layers: list[int]) -> None:
    """Refuse a checkpoint with no tensors for the first selected layer under the model's names
    (or the names transformers renames to them as it loads): the plugin reads one layer's
    tensors at a time by those names, so every layer's test would fail the same way."""
    if not layers:
        return
    path = model.layer_list[0]
    if model.checkpoint.layer_keys(path, layers[0]):
        return
    names = model.checkpoint.weight_map
    example = next((k for k in names if f".{layers[0]}." in k), next(iter(names), "none"))
    raise ModelError(
        f"the checkpoint in {model.model_dir} has no tensors for layer {layers[0]} under the model's names "
        f"({path}.{layers[0]}.*; a key there: {example!r}) nor under names transformers renames to them: it was not "
        f"saved from {model_class_name(model)} (config.json's architectures and model_type say which class reads it)"
    )


def model_class_name(model: ModelSource) -> str:
    return ", ".join(model.config_json.get("architectures") or []) or str(model.config_json.get("model_type"))


def check_attention_mode(model: ModelSource, seq_len: int) -> None:
    """Refuse a model that switches its layers' attention by the input's length as it runs
    (BigBird: block-sparse attention in config.json, switched to full attention for a sequence
    of at most (5 + 2 x num_random_blocks) x block_size tokens): a layer built alone keeps the
    config's, so it would not compute what the model's layer did."""
    config = model.hf_config
    if getattr(config, "attention_type", None) != "block_sparse":
        return
    blocks, size = getattr(config, "num_random_blocks", 3), getattr(config, "block_size", 64)
    limit = (5 + 2 * blocks) * size
    how = (
        f"for --seq-len {seq_len} (at most {limit} tokens) the model switches its layers to full attention as it runs"
        if seq_len <= limit
        else "the model switches its layers to full attention for each decode step (one token) as it runs"
    )
    raise ModelError(
        f"{model_class_name(model)}: config.json's attention_type is block_sparse, and {how}: a layer built alone "
        "keeps block-sparse attention, so it would not compute what the model's layer did; test a copy of the "
        'checkpoint whose config.json says "attention_type": "original_full" (what the model runs a short prompt with)'
    )
