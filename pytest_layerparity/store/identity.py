"""What ties a golden store to one extraction: the manifest fields that must agree, and the
check that refuses a store made from another model, shape or dtype."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..options import DTYPES
from .differences import describe_differences
from .golden import GoldenError

# Manifest fields that must agree for goldens to share one store.
EXTRACTION_KEYS = (
    "model.config_sha256",
    "model.num_layers",
    "model.hidden_size",
    "model.layer_module",
    "dtype",
    "reference_device",
    "inputs.source",
    "inputs.seed",
    "inputs.batch_size",
    "inputs.seq_len",
    "inputs.prompt",
    "inputs.decode_steps",
    "envelope.rule",
    "envelope.runs",
)
# What a parity run checks against the model it was given (and the dtype, when asked for one).
MODEL_KEYS = ("model.config_sha256", "model.num_layers", "model.hidden_size")


def check_store_matches(
    manifest: Mapping[str, Any] | None,
    manifest_path: Path,
    model_dir: Path,
    identity: Mapping[str, Any],
    dtype: str | None,
    fix: str,
) -> None:
    """Refuse a store made from another model, shape or dtype, saying what differs and the
    command (``fix``) that extracts it again (in the run's ``dtype``, where it asked for one)."""
    if manifest is None:
        return
    if manifest.get("dtype") not in DTYPES:
        raise GoldenError(
            f"{manifest_path}: dtype {manifest.get('dtype')!r} is not one of "
            f"{', '.join(DTYPES)}; extract the goldens again: {fix}"
        )
    differences = describe_differences(manifest, {"model": dict(identity)}, MODEL_KEYS)
    if differences:
        raise GoldenError(
            f"{manifest_path}: the goldens were made from another model or setting than "
            f"{model_dir} ({'; '.join(differences)}); extract them again for this model: {fix}"
        )
    if dtype and manifest["dtype"] != dtype:
        raise GoldenError(
            f"{manifest_path}: the goldens are {manifest['dtype']} and this run asks for --dtype {dtype}; drop "
            f"--dtype to test them in {manifest['dtype']}, or extract {dtype} goldens in their place: {fix}"
        )


def recorded_weights(manifest: Mapping[str, Any] | None, key: str, field: str) -> str | None:
    """The digest of the weights a layer's golden (``key``) was made from, as its manifest
    record holds it under ``field``; None where the store predates the digests."""
    record = ((manifest or {}).get("files") or {}).get(key)
    value = record.get(field) if isinstance(record, Mapping) else None
    return value if isinstance(value, str) else None


def check_weights_match(
    manifest: Mapping[str, Any],
    manifest_path: Path,
    index: int,
    model_dir: Path,
    recorded: str,
    found: str | None,
    fix: str,
) -> None:
    """Refuse layer ``index``'s goldens where the weights in ``model_dir`` (digest ``found``)
    are not the ones they were made from (``recorded``), naming both sources and the command
    (``fix``) that extracts them again from these weights."""
    if found == recorded:
        return
    source = str((manifest.get("model") or {}).get("path") or "an unrecorded folder")
    then = f"{source}, as it was then" if Path(source) == Path(model_dir) else source
    raise GoldenError(
        f"{manifest_path}: layer {index}'s weights in {model_dir} (sha256 {(found or 'none')[:12]}) are not the "
        f"weights its goldens were extracted from ({then}: sha256 {recorded[:12]}), so its tests would judge another "
        f"model's layer; extract the goldens again from these weights: {fix}"
    )
