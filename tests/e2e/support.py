"""Paths the end-to-end tests share."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / "fixtures" / "minimax_m2_tiny"
DEFAULT_GOLDENS = ROOT / "fixtures" / "goldens" / "minimax_m2_tiny"


def copy_goldens(dest: Path, decode: bool = True) -> Path:
    """A copy of the committed default goldens at ``dest``; ``decode=False``: as extracted with
    ``--decode-steps 0 --logits-topk 0`` (the layers' prompt goldens only), for tests about
    the per-layer prompt tests alone."""
    import json
    import shutil

    shutil.copytree(DEFAULT_GOLDENS, dest)
    if not decode:
        manifest = json.loads((dest / "manifest.json").read_text())
        for key in [k for k in manifest["files"] if ".decode_" in k or k == "model_logits"]:
            (dest / manifest["files"].pop(key)["file"]).unlink()
        manifest["inputs"]["decode_steps"] = 0
        (dest / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return dest
