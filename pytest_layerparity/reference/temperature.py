"""The attention's temperature as a direction of a layer's output (:func:`temperature_direction`),
measured in the precision floor's pass (:mod:`.floor`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

#: The attention's temperature, a direction ``branch_bias`` is measured along beside the
#: branches (``floor.branch.attention_temperature``): what the layer's output does when every
#: attention score is scaled by ``1 - TEMPERATURE_STEP`` before its softmax, per unit of that
#: scale, in the floor's pass. A port's attention scaled wrong (another softmax scale, a
#: temperature, soft-capping dropped) moves the output along it, and along no branch's output:
#: it changes how the values are mixed, not how much of the attention is added.
TEMPERATURE_BRANCH = "attention_temperature"
TEMPERATURE_STEP = 1e-3
#: The softmax functions whose 4-D input :class:`SofterAttention` scales.
SOFTMAX_FUNCTIONS = frozenset({torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax, torch.special.softmax})


class SofterAttention(TorchFunctionMode):
    """While active, every attention's scores are scaled by ``factor`` before their softmax:
    the ``scale`` of ``scaled_dot_product_attention``, and the input of a softmax over a 4-D
    tensor (batch, heads, queries, keys; a router's softmax is over tokens and experts).
    ``hits`` counts them."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor, self.hits = factor, 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.nn.functional.scaled_dot_product_attention:  # its scale is keyword-only
            scale = kwargs.get("scale")
            kwargs["scale"] = (scale if scale is not None else args[0].shape[-1] ** -0.5) * self.factor
            self.hits += 1
        elif func in SOFTMAX_FUNCTIONS and args and getattr(args[0], "dim", lambda: 0)() == 4:
            args = (args[0] * self.factor, *args[1:])
            self.hits += 1
        return func(*args, **kwargs)


def temperature_direction(
    run: Callable[[], torch.Tensor], out: torch.Tensor, max_output_cosine: float
) -> torch.Tensor | None:
    """How the layer's output ``out`` moves under a softer attention: ``run()`` (the same call
    made anew, in the same arithmetic) under :class:`SofterAttention`, minus ``out``, scaled
    to ``out``'s norm (a direction: its size is not used). None where no attention ran (no
    softmax of scores), or the move is nil, not finite, or along the output itself (a cosine
    over ``max_output_cosine``, the branches' own bound: a scale of the whole output, not a
    mixing)."""
    softer = SofterAttention(1 - TEMPERATURE_STEP)
    with softer:
        moved = run()
    if not softer.hits:
        return None
    d = moved.detach().sub_(out)  # in the pass's own dtype: one more output-sized tensor
    size, out_size = float(d.norm()), float(out.norm())
    along = float((d.flatten() @ out.detach().flatten().to(d.dtype)).abs())
    if not (0 < size < float("inf")) or out_size == 0 or along > max_output_cosine * size * out_size:
        return None
    return d.mul_(out_size / size)
