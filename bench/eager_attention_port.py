"""A correct port of another kind for bench_trained.py, which copies it in as a conftest.py: the
model's own layer with transformers' eager attention (scores and probabilities in the golden's
dtype) where the golden ran the fused kernel; the golden call's mask is in the fused kernel's
form (a boolean one made additive, a causal attention's built where the call passes none)."""

from __future__ import annotations

import copy
import importlib

import torch
from transformers import AttentionInterface


def _eager_causal(module, query, key, value, attention_mask, **kwargs):
    modeling = importlib.import_module(type(module).__module__)
    if attention_mask is not None and attention_mask.dtype == torch.bool:  # the fused kernel's form: True sees
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min
        )
    if attention_mask is None and query.shape[-2] > 1 and getattr(module, "is_causal", False):
        q, k = query.shape[-2], key.shape[-2]
        seen = torch.ones(q, k, dtype=torch.bool, device=query.device).tril(diagonal=k - q)
        attention_mask = torch.zeros(q, k, dtype=query.dtype, device=query.device)
        attention_mask = attention_mask.masked_fill(~seen, torch.finfo(query.dtype).min)[None, None]
    return modeling.eager_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("eager_causal", _eager_causal)


def pytest_layerparity_build_target_layer(layer_idx, reference_layer, model_config, device):
    layer = reference_layer.to(device)
    for module in layer.modules():
        if hasattr(module, "config") and hasattr(module.config, "_attn_implementation"):
            module.config = copy.copy(module.config)
            module.config._attn_implementation = "eager_causal"
    return layer
