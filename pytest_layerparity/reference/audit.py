"""The dtype audit of a unit of weights: tensors whose floating dtype differs from the one
requested, a refusal when float32 tensors under a 16-bit request would multiply the memory
(the seeds' 1 TB bug), and the reference's own forward failing on such tensors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class Audit:
    odd: list[tuple[str, str, tuple[int, ...]]]
    fatal: bool
    message: str


def dtype_audit(module: Any, requested: Any, keep: Any = None, fatal_share: float = 0.01) -> Audit:
    """Parameters and buffers whose floating dtype differs from ``requested``. Fatal when
    float32 tensors under a 16-bit request hold more than ``fatal_share`` of the unit's bytes
    (small float32 biases and modules the model keeps in float32 on purpose are reported only)."""
    import torch

    keep = set(keep or ())
    odd, wide, total = [], 0, 0
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if tensor is None or not torch.is_floating_point(tensor) or tensor.device.type == "meta":
            continue
        nbytes = tensor.numel() * tensor.element_size()
        total += nbytes
        if tensor.dtype != requested:
            odd.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)))
            if (
                tensor.dtype == torch.float32
                and requested in (torch.bfloat16, torch.float16)
                and not any(k in name for k in keep)
            ):
                wide += nbytes
    fatal = total > 0 and wide / total > fatal_share
    message = ""
    if fatal:
        names = ", ".join(f"{n} ({d}, {list(s)})" for n, d, s in odd if d == "float32")
        message = (
            f"would materialise in float32 under a {str(requested).removeprefix('torch.')} request "
            f"({wide / 1e6:.1f} MB of {total / 1e6:.1f} MB): {names}; cast these tensors to the requested dtype "
            "in the port (or pass --dtype float32)"
        )
    return Audit(odd, fatal, message)


@contextlib.contextmanager
def mixed_dtype_failure(model: Any, requested: Any, keep: Any = ()) -> Iterator[None]:
    """The model's own forward failing on mixed dtypes becomes a ModelError naming the tensors
    it holds in another dtype than ``requested`` (those not kept so on purpose, ``keep``): the
    model as transformers builds it does not run in that dtype. Any other error passes."""
    from ..errors import ModelError

    try:
        yield
    except RuntimeError as exc:
        first = (str(exc).splitlines() or [""])[0]
        keep = tuple(keep or ())
        odd = [(n, d) for n, d, _ in dtype_audit(model, requested).odd if not any(k in n for k in keep)]
        if ("dtype" not in first and "scalar type" not in first) or not odd:
            raise
        dtype = str(requested).removeprefix("torch.")
        names = ", ".join(f"{n} ({d})" for n, d in odd[:6]) + (f" and {len(odd) - 6} more" if len(odd) > 6 else "")
        raise ModelError(
            f"the reference model's own forward fails in {dtype} ({type(exc).__name__}: {first}): "
            f"transformers builds {type(model).__name__} with tensors in another dtype than --dtype {dtype}, "
            f"which the model does not mark to keep so: {names}; the model as transformers builds it does "
            "not run in this dtype, so it has no golden in it: extract with --dtype float32 (or make a "
            "checkpoint whose model casts them)"
        ) from exc
