"""Tests of ``--port nxdi`` against the real neuronx-distributed-inference sources, in their
own environment (transformers 4.57 and the vendored NxD and NxDI, as ``.ci/run`` builds it):
``pytest tests/nxdi``. The goldens they use were extracted with transformers 5
(``fixtures/make_nxdi_fixtures.py``); nothing here may import transformers 5."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "fixtures"))


def pytest_configure(config: pytest.Config) -> None:
    """NxDI must import here (this folder tests it); the imports are done once, before any
    in-process pytester run (which restores sys.modules after each)."""
    import transformers

    if int(transformers.__version__.split(".", 1)[0]) >= 5:
        raise pytest.UsageError(
            f"tests/nxdi runs under NxDI's transformers (4.57), not {transformers.__version__}: "
            "run it in the second environment .ci/run builds (.venv-nxdi)"
        )
    import torch.distributed._functional_collectives  # noqa: F401

    from pytest_layerparity.ports import nxdi, standins

    standins.install()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NxD's own deprecation warnings at import
        try:
            import neuronx_distributed_inference  # noqa: F401
        except ImportError as exc:
            raise pytest.UsageError(f"tests/nxdi needs NxD and NxDI installed from third_party/neuron ({exc})") from exc
        for spec in nxdi.APPLICATIONS.values():
            nxdi.import_application(None, spec)
    import pytest_layerparity.session  # noqa: F401
    from pytest_layerparity.replay import runner  # noqa: F401
