"""Model-side helpers: read a checkpoint's config, build a weightless skeleton, and find its
decoder-layer list. (The weights: :mod:`.checkpoint`; one model folder as the stages use
it: :mod:`.source`.)

Nothing here is specific to one architecture: the layer list is found by name among the
common HF layouts, or by the model's own ``nn.ModuleList`` whose length is the configured
layer count, or named by the user (ini key ``layerparity_layer_module``).
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ModelError

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


def capped_attention(config: Any) -> str | None:
    """The attention implementation a model whose attention logits are soft-capped
    (Gemma-2's ``attn_logit_softcapping``) is run with where none is asked for: ``eager``, the
    one that caps them. Transformers before 5.24 gave such a model SDPA by default, which
    leaves the capping out (a golden of another model, with no error); later ones refuse SDPA
    for it themselves. None for any other model: the library's default."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return "eager" if getattr(text, "attn_logit_softcapping", None) else None


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
                f"layerparity_layer_module = {layer_module!r} is not a list of layers in {type(model).__name__}; "
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
        f"-o layerparity_layer_module=PATH or that ini key (module lists in this model: "
        f"{', '.join(module_lists(model)) or 'none'})"
    )


def module_lists(model: torch.nn.Module) -> list[str]:
    import torch

    return [f"{name} ({len(mod)})" for name, mod in model.named_modules() if isinstance(mod, torch.nn.ModuleList)]
