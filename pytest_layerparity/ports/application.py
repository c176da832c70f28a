"""NxDI's application class of a checkpoint (``NeuronLlamaForCausalLM`` and the rest): which
one, the HuggingFace config it reads, and the decoder layer class its model builds."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

from .nxd_common import PortError

#: NxDI's application class of each architecture whose decoder layer has been run here
#: against transformers' (NxDI's ``utils.constants.MODEL_TYPES`` lists the same classes).
APPLICATIONS = {
    "llama": "neuronx_distributed_inference.models.llama.modeling_llama:NeuronLlamaForCausalLM",
    "mixtral": "neuronx_distributed_inference.models.mixtral.modeling_mixtral:NeuronMixtralForCausalLM",
    "qwen3_moe": "neuronx_distributed_inference.models.qwen3_moe.modeling_qwen3_moe:NeuronQwen3MoeForCausalLM",
    "qwen2": "neuronx_distributed_inference.models.qwen2.modeling_qwen2:NeuronQwen2ForCausalLM",
    "qwen3": "neuronx_distributed_inference.models.qwen3.modeling_qwen3:NeuronQwen3ForCausalLM",
    "mistral": "neuronx_distributed_inference.models.mistral.modeling_mistral:NeuronMistralForCausalLM",
    # runs, and differs from transformers' Gemma-3 (docs/nxdi-and-trainium.md, "Findings on NxDI's Gemma-3")
    "gemma3": "neuronx_distributed_inference.models.gemma3.modeling_gemma3:NeuronGemma3ForCausalLM",
}


#: NxDI's release decoders that cannot run as a layer port on the CPU, and why
#: (docs/nxdi-and-trainium.md, "NxDI's release decoders"): refused by model_type before any
#: work, unless layerparity_nxdi_app names a class.
NOT_RUNNABLE = {
    "gpt_oss": "NxDI's GPT-OSS layer is built with a rotary cache manager its model owns and called with cos/sin "
    "caches, not a layer the plugin can build alone, and its converter reads the released MXFP4 expert tensors "
    "(*_blocks, *_scales)",
    "dbrx": "NxDI's DBRX layer is NeuronDbrxBlock (block_idx, checkpoint prefix transformer.blocks.N), not a "
    "*DecoderLayer the plugin builds",
    "llama4": "NxDI's Llama 4 module has two decoder layer classes (MoE and dense, chosen per layer by its model) "
    "and its config reads the composite checkpoint's text_config",
    "llama4_text": "NxDI's Llama 4 reads the composite llama4 checkpoint (text_config), and its module has two "
    "decoder layer classes",
    "deepseek_v3": "NxDI's models/deepseek has no application or decoder layer class (a config, an RMSNorm and "
    "the MLA attention only)",
}


# -- the config ------------------------------------------------------------------------------


def hf_config_for_nxdi(config_json: dict[str, Any]) -> Any:
    """The HuggingFace config NxDI's ``load_pretrained_config`` reads, made from config.json
    under the transformers installed with NxDI (4.57), with the fields transformers 5 renamed
    under their old names too (:func:`transformers_4_names`). An architecture that
    transformers does not know becomes a plain ``PretrainedConfig`` of the file's fields (no
    modeling class is imported)."""
    from transformers import AutoConfig, PretrainedConfig

    from ..model.build import transformers_4_names

    fields = {**config_json, **transformers_4_names(config_json)}
    model_type = fields.pop("model_type", None)
    fields.pop("transformers_version", None)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError):
        config = PretrainedConfig(**fields)
        config.model_type = model_type
        return config


# -- the application class ---------------------------------------------------------------------


def import_application(model_type: str | None, spec: str | None = None) -> type:
    """The NxDI application class: ``spec`` (``module:Class``) when given, else NxDI's class
    for ``model_type``."""
    if spec is None:
        spec = APPLICATIONS.get(model_type or "")
        if spec is None and model_type in NOT_RUNNABLE:
            raise PortError(
                f"--port nxdi: {NOT_RUNNABLE[model_type]}; a port of your own of it: "
                "-o layerparity_nxdi_app=package.module:NeuronXForCausalLM"
            )
        if spec is None:
            raise PortError(
                f"--port nxdi: no NxDI application class known for model_type {model_type!r} (known: "
                f"{', '.join(sorted(APPLICATIONS))}); name one with "
                "-o layerparity_nxdi_app=package.module:NeuronXForCausalLM"
            )
    module_name, _, class_name = spec.partition(":")
    if not class_name:
        raise PortError(f"layerparity_nxdi_app = {spec!r}: write it as package.module:ClassName")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PortError(f"--port nxdi: cannot import {module_name} ({exc})") from exc
    app = getattr(module, class_name, None)
    if app is None:
        raise PortError(f"layerparity_nxdi_app = {spec!r}: {module_name} has no {class_name}")
    for needed in ("convert_hf_to_neuron_state_dict", "get_config_cls"):
        if not hasattr(app, needed):
            raise PortError(
                f"layerparity_nxdi_app = {spec!r}: {class_name} has no {needed} (not an NxDI application class?)"
            )
    return app


def decoder_layer_class(app: type) -> type:
    """The decoder layer class of an application class: the ``*DecoderLayer`` module class
    its model class instantiates (looked up in the model class's module)."""
    model_cls = getattr(app, "_model_cls", None)
    modules = [inspect.getmodule(c) for c in (model_cls, app) if c is not None]
    found = []
    for module in modules:
        for name, obj in vars(module).items():
            if (
                isinstance(obj, type)
                and issubclass(obj, torch.nn.Module)
                and name.endswith("DecoderLayer")
                and obj.__module__ == module.__name__
            ):
                found.append(obj)
        if found:
            break
    if len(found) != 1:
        names = ", ".join(c.__name__ for c in found) or "none"
        raise PortError(
            f"{app.__name__}: expected one *DecoderLayer class in "
            f"{modules[0].__name__ if modules else '?'}, found {names}"
        )
    return found[0]
