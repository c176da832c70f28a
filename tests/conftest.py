from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "fixtures" / "minimax_m2_tiny"
DEFAULT_GOLDENS = ROOT / "fixtures" / "goldens" / "minimax_m2_tiny"


@pytest.fixture
def project(pytester: pytest.Pytester):
    """A pytester folder whose ini points the plugin at the embedded default model and a
    copy of its committed goldens (so tests may damage them)."""
    goldens = pytester.path / "goldens"
    shutil.copytree(DEFAULT_GOLDENS, goldens)
    pytester.makeini(
        f"""
        [pytest]
        layerparity_model = {DEFAULT_MODEL}
        layerparity_golden_dir = goldens
        """
    )
    return pytester


def pytest_configure(config):
    """Import what the plugin imports lazily, once, before any in-process pytester run:
    pytester restores sys.modules after each inner run, and torch refuses to register its
    operators a second time when a module is imported again."""
    import torch  # noqa: F401
    import torch.distributed._functional_collectives  # noqa: F401
    from transformers import AutoModelForCausalLM

    from pytest_layerparity import capture, golden, metrics, modeling, session  # noqa: F401

    AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL))
    modeling.build_skeleton(modeling.load_hf_config(DEFAULT_MODEL), torch.float32)
