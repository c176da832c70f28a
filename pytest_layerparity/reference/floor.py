"""The precision floor: a layer evaluated in higher precision (float32 for 16-bit goldens,
float64 for float32 ones; on the CPU). Extraction stores it with each golden; chained runs
evaluate it along the chain. The verdict measures the target's error against it in units of
the golden's own rounding error.

The layer's weights stay in the golden's dtype: every op is computed in the floor dtype on
its operands widened for that op alone (:class:`~.wider.WiderArithmetic`), which gives
what the layer with its weights converted computes (the conversion is exact) without a
second, wider copy of the layer in memory."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ..capture.routing import capture_routing, floor_routing
from ..store.callspec import appended_kv, cache_argument, decode_call, first_tensor, replace_hidden_input
from .checkpoint import load_layer
from .memory import give_back_memory
from .model import eager_experts_skeleton
from .source import ModelSource

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


FLOOR_NEW_KEYS = "floor.cache.new_keys"
FLOOR_NEW_VALUES = "floor.cache.new_values"


def floor_dtype(golden_dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit goldens, float64 for float32 ones."""
    import torch

    return torch.float64 if golden_dtype == torch.float32 else torch.float32


class FloorEvaluator:
    """Evaluates the layers of one model in the floor dtype of ``golden_dtype``."""

    def __init__(self, model: ModelSource, golden_dtype: torch.dtype) -> None:
        self.model = model
        self.golden_dtype = golden_dtype
        self.dtype = floor_dtype(golden_dtype)

    @cached_property
    def skeleton(self) -> PreTrainedModel:
        return eager_experts_skeleton(self.model.hf_config, self.golden_dtype, self.model.trust_remote_code)

    def load(self, index: int) -> torch.nn.Module:
        """Layer ``index`` in the golden dtype on the CPU, with eager experts (what the floor
        evaluates; the noise envelope's runs use the same build)."""
        return load_layer(
            self.skeleton, self.model.checkpoint, self.model.layer_list[0], index, self.golden_dtype
        ).eval()

    def evaluate(
        self,
        index: int,
        spec: Mapping[str, Any],
        tensors: Mapping[str, torch.Tensor],
        hidden: torch.Tensor | None = None,
        layer: torch.nn.Module | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Layer ``index`` on the call ``spec``/``tensors`` (hidden states replaced by
        ``hidden`` when given, for chains), in the floor dtype. Returns the output and the
        routers' exact logits and scores (``floor.routing.*``), and for a decode step the keys
        and values the layer appended to its KV cache (``floor.cache.new_keys``/``new_values``).
        ``layer``: the layer already loaded (by :meth:`load`), else it is loaded and given back."""
        import torch

        from .tokens import in_token_blocks
        from .wider import WiderArithmetic

        owned = layer is None
        if layer is None:
            layer = self.load(index)
        upcast = {k: (v.to(self.dtype) if torch.is_floating_point(v) else v) for k, v in tensors.items()}
        if hidden is not None:
            upcast = replace_hidden_input(spec, upcast, hidden)
        args, kwargs = decode_call(spec, upcast, cache_name=cache_argument(layer))
        routing: dict[str, torch.Tensor] = {}
        with (
            torch.no_grad(),
            capture_routing(layer, self.model.top_k, routing),
            in_token_blocks(layer),
            WiderArithmetic(self.dtype),
        ):
            out = first_tensor(layer(*args, **kwargs))
        extras = floor_routing(routing)
        appended = appended_kv(args, kwargs, spec, upcast)
        if appended is not None:
            extras[FLOOR_NEW_KEYS], extras[FLOOR_NEW_VALUES] = (t.detach().to("cpu", self.dtype) for t in appended)
        del args, kwargs, upcast
        if owned:
            del layer
        give_back_memory()  # the wider pass's freed temporaries (and the layer, when owned)
        return out.detach().to("cpu", self.dtype), extras
