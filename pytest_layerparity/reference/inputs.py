"""The golden input: seeded random token ids, or a prompt through the model's tokenizer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ModelError

if TYPE_CHECKING:
    import torch

    from ..options import Settings

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_prompt(settings: Settings, model_dir: Path) -> None:
    """Refuse ``--prompt`` for a model folder without a tokenizer, before anything runs."""
    if settings.prompt is None:
        return
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ModelError(
            f"--prompt needs the model's tokenizer, and {model_dir} has none "
            f"({', '.join(TOKENIZER_FILES)}); drop --prompt to use seeded random token ids"
        )


def input_description(settings: Settings) -> dict[str, Any]:
    """The ``inputs`` of a store's manifest (what a later run must match)."""
    if settings.prompt is not None:
        return {
            "source": "prompt",
            "prompt": settings.prompt,
            "seed": None,
            "batch_size": 1,
            "seq_len": None,
            "decode_steps": settings.decode_steps,
        }
    return {
        "source": "random",
        "prompt": None,
        "seed": settings.seed,
        "batch_size": settings.batch_size,
        "seq_len": settings.seq_len,
        "decode_steps": settings.decode_steps,
    }


def stored_input_shape(settings: Settings, manifest: Mapping[str, Any] | None) -> Settings:
    """``settings`` with the batch and length of a store's input (its manifest's ``inputs``),
    where the store records them: the input a verification re-runs."""
    inputs = (manifest or {}).get("inputs") or {}
    batch, seq = inputs.get("batch_size"), inputs.get("seq_len")
    return replace(
        settings,
        batch_size=int(batch) if batch else settings.batch_size,
        seq_len=int(seq) if seq else settings.seq_len,
    )


def make_input_ids(settings: Settings, model_dir: Path, vocab_size: int) -> torch.Tensor:
    """The token ids the reference runs on."""
    import torch

    if settings.prompt is not None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        except (OSError, ValueError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelError(
                f"--prompt needs the model's tokenizer, and {model_dir} has none that loads ({reason}); "
                "drop --prompt to use seeded random token ids"
            ) from exc
        return tokenizer(settings.prompt, return_tensors="pt")["input_ids"]
    generator = torch.Generator().manual_seed(settings.seed)
    return torch.randint(0, vocab_size, (settings.batch_size, settings.seq_len), generator=generator)
