"""What a golden's file must hold to be used (:mod:`.golden` reads it): its metadata, a layer
entry's call spec and every tensor it names, the whole model's compact logits; tensors of an
older schema under this one's names."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..compare.envelope import Envelope
from ..compare.floor import FLOOR_PREFIX
from ..selection import golden_layer
from .callspec import tensor_names

if TYPE_CHECKING:
    import torch

LEGACY_FLOOR_PREFIX = "ref_"


def current_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An entry's tensors under this schema's names: a floor written as ``ref_X`` (schema 1,
    and entries of schema 1 in a store extracted into again) is ``floor.X``."""
    if not any(name.startswith(LEGACY_FLOOR_PREFIX) for name in tensors):
        return tensors
    return {
        FLOOR_PREFIX + name.removeprefix(LEGACY_FLOOR_PREFIX) if name.startswith(LEGACY_FLOOR_PREFIX) else name: t
        for name, t in tensors.items()
    }


def read_metadata(payload: bytes) -> dict[str, Any]:
    if len(payload) < 8:
        raise ValueError("file too short")
    header_len = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + header_len])
    if not isinstance(header, dict):
        raise ValueError("the safetensors header is not a JSON object")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise ValueError("the safetensors metadata is not a JSON object")
    raw = meta.get("layerparity")
    if not raw:
        return {}
    if not isinstance(raw, str):
        raise ValueError("the layerparity metadata is not a string")
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError("the layerparity metadata is not a JSON object")
    return value


def check_layer_entry(key: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> None:
    """A layer entry must hold its call spec, be the golden of that layer, and hold every
    tensor its call refers to (else replaying it would fail deep inside the test)."""
    index = golden_layer(key)
    if index is None:
        return
    call = metadata.get("call")
    if not isinstance(call, dict):
        raise ValueError(f"{key}: the file holds no call spec (its 'call' metadata is missing)")
    layer = metadata.get("layer")
    if layer is not None and layer != index:
        raise ValueError(f"{key}: the file holds the golden of layer {layer!r}, not of {key}")
    missing = sorted(set(tensor_names(call)) - set(tensors))
    if missing:
        raise ValueError(f"{key}: its call refers to tensors the file does not hold ({', '.join(missing)})")
    try:
        Envelope.from_metadata(metadata.get("envelope"))
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


def check_model_logits(key: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> None:
    """The whole model's golden must hold its compact logits for every position it fed."""
    from ..compare.logits import LOGSUMEXP, TOPK_IDS, TOPK_LOGITS, ModelEnvelope

    missing = sorted({TOPK_IDS, TOPK_LOGITS, LOGSUMEXP, "input_ids"} - set(tensors))
    if missing:
        raise ValueError(f"{key}: the whole model's golden lacks {', '.join(missing)}")
    fed = tensors["input_ids"].shape[-1] + (tensors["decode_ids"].shape[-1] if "decode_ids" in tensors else 0)
    if tensors["topk_ids"].shape[:-1] != tensors["logsumexp"].shape or tensors["logsumexp"].shape[-1] != fed:
        raise ValueError(
            f"{key}: the whole model's golden holds logits of {tuple(tensors['logsumexp'].shape)} "
            f"positions for {fed} tokens fed"
        )
    try:
        ModelEnvelope.from_metadata(metadata.get("envelope"))
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None
