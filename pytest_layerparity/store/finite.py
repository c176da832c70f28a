"""Tensors a golden must not hold: NaN anywhere, Inf in hidden states (masks may hold -inf
legitimately), found by chunked float64 sums in the common case."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..compare.floor import FLOOR_KEY

if TYPE_CHECKING:
    import torch


#: Elements of a tensor summed at once by :func:`check_finite`: the sum converts them to float64
#: first, so a chunk holds 8 bytes an element (2 MB), whatever the tensor's size.
FINITE_CHUNK = 1 << 18


def all_finite_by_sum(tensor: torch.Tensor, chunk: int = FINITE_CHUNK) -> bool:
    """Whether every value of a 16- or 32-bit ``tensor`` is finite: chunked float64 sums, no
    mask of the tensor's size."""
    import torch

    flat = tensor.reshape(-1)
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, flat.numel(), chunk):
        total += torch.sum(flat[start : start + chunk], dtype=torch.float64)
    return bool(torch.isfinite(total))


def check_finite(key: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuse NaN anywhere and Inf in hidden states (masks may hold -inf legitimately)."""
    import torch

    for name, tensor in tensors.items():
        if not torch.is_floating_point(tensor):
            continue
        # The common case in one cheap pass: a float64 sum is finite exactly when every value
        # is (16- and 32-bit values cannot overflow it); in chunks, since the sum converts its
        # input to float64 first (logits of 2k tokens x 32k vocabulary: 0.5 GB at once; a
        # chunk of 2^22 elements held 32 MB beside a layer of a few, measured).
        if tensor.dtype != torch.float64 and all_finite_by_sum(tensor):
            continue
        nan = torch.isnan(tensor)
        if bool(nan.any()):
            index = tuple(int(i) for i in torch.nonzero(nan)[0])
            raise ValueError(f"{key}: tensor {name!r} holds NaN (first at index {index})")
        if _is_hidden_state(name):
            inf = torch.isinf(tensor)
            if bool(inf.any()):
                index = tuple(int(i) for i in torch.nonzero(inf)[0])
                raise ValueError(f"{key}: tensor {name!r} holds Inf (first at index {index})")


def split_nonfinite(key: str, tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(the tensors check_finite accepts, {name: why} for those it refuses)."""
    kept: dict[str, torch.Tensor] = {}
    omitted: dict[str, str] = {}
    for name, tensor in tensors.items():
        try:
            check_finite(key, {name: tensor})
        except ValueError as exc:
            omitted[name] = str(exc)
        else:
            kept[name] = tensor
    return kept, omitted


def _is_hidden_state(name: str) -> bool:
    return name.startswith(("output", "args.0", FLOOR_KEY)) or name in {"embeddings", "logits"}
