"""Paths the end-to-end tests share."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / "fixtures" / "minimax_m2_tiny"
DEFAULT_GOLDENS = ROOT / "fixtures" / "goldens" / "minimax_m2_tiny"
