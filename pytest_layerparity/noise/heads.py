"""Each attention head's own part of the layer's output, kept in the floor's pass for the
diagnosis (``floor.heads``: ``compare.sketch``): what the attention's output projection
makes of that head's slice of its input. A port that drops a head, or reads one wrong,
moves the output along its head's part."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: The names an attention's output projection goes by (Llama's and most decoders', GPT-NeoX's,
#: Phi's and BERT's, OPT's, GPT-2's, T5's).
OUTPUT_PROJECTIONS = ("o_proj", "dense", "out_proj", "c_proj", "wo")
#: The attributes an attention keeps its head width in, the values' first (an attention whose
#: queries and keys are wider than its values, as multi-head latent attention's, keeps both).
HEAD_WIDTHS = ("v_head_dim", "head_dim", "head_size", "attention_head_size")


def output_projection(attention: torch.nn.Module) -> tuple[torch.nn.Linear, int] | None:
    """The attention's output projection (a linear layer named as in ``OUTPUT_PROJECTIONS``)
    and its head width; None where either is not found or the widths do not divide."""
    width = next(
        (
            value
            for attribute in HEAD_WIDTHS
            for module in attention.modules()
            if isinstance(value := getattr(module, attribute, None), int) and value > 0
        ),
        None,
    )
    projection = next(
        (
            module
            for name, module in attention.named_modules()
            if name.rsplit(".", 1)[-1] in OUTPUT_PROJECTIONS and isinstance(module, torch.nn.Linear)
        ),
        None,
    )
    if width is None or projection is None or projection.in_features % width or projection.in_features == width:
        return None
    return projection, width


@contextmanager
def capture_heads(attention: torch.nn.Module | None, out: dict[str, Any]) -> Iterator[None]:
    """While active, the input of ``attention``'s output projection is kept in
    ``out["context"]`` beside the projection and the head width (``out["projection"]``,
    ``out["width"]``); a projection called more than once is left out."""
    found = output_projection(attention) if attention is not None else None
    if found is None:
        yield
        return
    calls = [0]

    def keep(_module: Any, args: Any) -> None:
        calls[0] += 1
        if calls[0] == 1 and args and isinstance(args[0], torch.Tensor):
            out["context"] = args[0].detach().clone()
        else:
            out.pop("context", None)

    handle = found[0].register_forward_pre_hook(keep)
    out["projection"], out["width"] = found
    try:
        yield
    finally:
        handle.remove()


def head_parts(captured: dict[str, Any], shape: torch.Size) -> list[torch.Tensor]:
    """Each head's part of the projection's output (its slice of the input through its slice
    of the weight, no bias), in the output's ``shape``; none where nothing was captured or the
    projection's output is not of that shape."""
    context, projection, width = captured.get("context"), captured.get("projection"), captured.get("width")
    if context is None or projection is None or context.shape[-1] != projection.in_features:
        return []
    weight = projection.weight.detach().to(context.dtype)
    parts = []
    for start in range(0, projection.in_features, width):
        part = context[..., start : start + width] @ weight[:, start : start + width].T
        if part.numel() != shape.numel():
            return []
        parts.append(part.reshape(shape))
    return parts
