"""The model NxDI compiles for each model tag, made the way NxDI's causal-LM application makes
it, for one decoder layer.

NxDI compiles a context-encoding model (the prompt pass) and a token-generation model (a decode
step). ``NeuronBaseForCausalLM.enable_context_encoding`` and ``enable_token_generation``
(``models/model_base.py``) each put the tag's settings in a copy of the application's config
(batch size, ``n_active_tokens``, ``bucket_n_active_tokens``, ``is_prefill_stage``, the buckets,
and for token generation no sequence parallelism) and wrap it in a ``ModelWrapper``
(``models/model_wrapper.py``), which completes the compiler arguments, adjusts the config it is
given (token generation: ``cc_pipeline_tiling_factor`` 1 where the application has no compiler
arguments of its own) and holds ``priority_model_idx``: 0 (the weight-layout optimisation) for
token generation, None for context encoding. :func:`tag_model` calls the application's own
``enable_*`` method on a probe of the application (no model is loaded), so an application that
wraps them (Qwen3-MoE's and Gemma-3's set the ``compile_tag`` their ``get_compiler_args``
reads) is followed too. The decoder layer is then built from the tag's config as NxDI's model
builds layer N (:func:`layer_config`, :func:`make_layer`).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch


def program_tag(past: bool) -> str:
    """The NxDI model a call belongs to: token generation for a decode step (a past is given),
    context encoding for the prompt pass."""
    from neuronx_distributed_inference.models.model_wrapper import (
        CONTEXT_ENCODING_MODEL_TAG,
        TOKEN_GENERATION_MODEL_TAG,
    )

    return TOKEN_GENERATION_MODEL_TAG if past else CONTEXT_ENCODING_MODEL_TAG


def tag_model(app: type, config: Any, tag: str) -> Any:
    """The ``ModelWrapper`` NxDI's application ``app`` makes for ``tag`` from ``config`` (its
    ``config`` the tag's, its ``compiler_args``, its ``priority_model_idx``): the application's
    own ``enable_context_encoding`` / ``enable_token_generation``, on a copy of ``config``."""
    from neuronx_distributed_inference.models.model_wrapper import (
        CONTEXT_ENCODING_MODEL_TAG,
        TOKEN_GENERATION_MODEL_TAG,
    )

    probe = app.__new__(app)  # the application's own methods, without loading a model
    torch.nn.Module.__init__(probe)
    probe.config = copy.deepcopy(config)
    probe.neuron_config = probe.config.neuron_config
    probe.models = []
    probe.model_wrapper = probe.get_model_wrapper_cls()
    enable = {
        CONTEXT_ENCODING_MODEL_TAG: probe.enable_context_encoding,
        TOKEN_GENERATION_MODEL_TAG: probe.enable_token_generation,
    }[tag]
    enable()
    (wrapper,) = probe.models
    return wrapper


def layer_config(layer_cls: type, config: Any, index: int) -> Any:
    """Layer ``index``'s config as NxDI's model class builds the layer: where the layer's module
    has ``get_updated_configs`` (Gemma-3, GPT-OSS, Llama 4: which layers slide, chunk or skip
    RoPE), its ``index``-th per-layer config; else the model's."""
    per_layer = getattr(inspect.getmodule(layer_cls), "get_updated_configs", None)
    return per_layer(config)[index] if callable(per_layer) else config


def make_layer(layer_cls: type, config: Any, index: int) -> torch.nn.Module:
    """NxDI's decoder layer ``index`` of ``layer_cls`` for ``config`` (with ``layer_idx`` where it takes one)."""
    params = inspect.signature(layer_cls.__init__).parameters
    return layer_cls(config, index) if "layer_idx" in params else layer_cls(config)
