"""A decoder layer's weights as one digest: what binds a golden to the weights it was made
from. Read from the checkpoint's own tensors of the layer (a layer at a time, never the whole
checkpoint), so it does not depend on the transformers release that builds the layer."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .checkpoint import Checkpoint

#: The manifest's name for the digest (the scheme is in the name: a new scheme gets a new one).
WEIGHTS_FIELD = "weights_sha256"


def tensor_digest(tensor: torch.Tensor, dtype: torch.dtype) -> str:
    """sha256 of ``tensor``'s bytes in ``dtype`` (a floating tensor cast as the loader casts it,
    so a float32 copy of bfloat16 goldens' weights reads as the same weights; any other tensor
    as stored)."""
    import torch

    if tensor.is_floating_point() and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()  # hashlib lets go of the GIL on large buffers


def layer_fingerprint(checkpoint: Checkpoint, layer_path: str, index: int, dtype: torch.dtype) -> str | None:
    """The digest of layer ``index``'s checkpoint tensors in ``dtype``: each tensor's name,
    shape and bytes, in name order; None for a layer with no tensors of its own (one that
    shares another's)."""
    keys = sorted(checkpoint.layer_keys(layer_path, index))
    if not keys:
        return None

    def digest(key: str) -> str:
        tensor = checkpoint.read([key])[key]
        return f"{key} {list(tensor.shape)} {tensor_digest(tensor, dtype)}\n"

    with ThreadPoolExecutor(max_workers=4) as pool:
        lines = list(pool.map(digest, keys))
    return hashlib.sha256("".join(lines).encode()).hexdigest()
