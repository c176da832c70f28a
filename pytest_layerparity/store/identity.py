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
    command (``fix``) that extracts it again."""
    if manifest is None:
        return
    if manifest.get("dtype") not in DTYPES:
        raise GoldenError(
            f"{manifest_path}: dtype {manifest.get('dtype')!r} is not one of "
            f"{', '.join(DTYPES)}; extract the goldens again: {fix}"
        )
    expected: dict[str, Any] = {"model": dict(identity)}
    keys = MODEL_KEYS
    if dtype:
        expected["dtype"] = dtype
        keys += ("dtype",)
    differences = describe_differences(manifest, expected, keys)
    if differences:
        raise GoldenError(
            f"{manifest_path}: the goldens were made from another model or setting than "
            f"{model_dir} ({'; '.join(differences)}); extract them again for this model: {fix}"
        )
