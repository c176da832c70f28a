"""End-to-end tests: the plugin run as a user runs it (pytester), on the embedded default
model and torch-xla's CPU device, and the slower checks of its parts: in a process of their
own, or on a checkpoint written for them."""

from __future__ import annotations

import pytest
from support import DEFAULT_MODEL, default_project


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    """A pytester folder whose ini points the plugin at the embedded default model and a
    copy of its committed prompt goldens (so tests may damage them; the decode-step tests
    use ``decode_project``)."""
    return default_project(pytester, decode=False)


@pytest.fixture
def decode_project(pytester: pytest.Pytester) -> pytest.Pytester:
    """Like ``project``, with the committed decode-step goldens too."""
    return default_project(pytester)


def pytest_configure(config: pytest.Config) -> None:
    """Import what the plugin imports lazily, once, before any in-process pytester run:
    pytester restores sys.modules after each inner run, and torch refuses to register its
    operators a second time when a module is imported again."""
    from pytest_layerparity.options import read_settings

    if read_settings(config).mode is not None:
        return  # the plugin's own run (the README's main job in this folder): nothing of the suite's
    import torch
    import torch.distributed._functional_collectives
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    import pytest_layerparity.session  # noqa: F401
    from pytest_layerparity.model import build as model
    from pytest_layerparity.reference import extract  # noqa: F401
    from pytest_layerparity.replay import runner  # noqa: F401

    hf_logging.disable_progress_bar()
    try:
        AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL))
    finally:
        hf_logging.enable_progress_bar()
    model.build_skeleton(model.load_hf_config(DEFAULT_MODEL), torch.float32)
