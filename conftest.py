"""The project's own test configuration.

With a layerparity mode on (``pytest --xla``, ``pytest --gpu-golden --extract``), this
repository runs the plugin's tests on the embedded default model and not its own suite.
"""
from __future__ import annotations

from pathlib import Path

_TESTS = Path(__file__).parent / "tests"


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    modes = ("layerparity_gpu_golden", "layerparity_xla", "layerparity_neuron", "layerparity_target")
    if any(config.getoption(name, None) for name in modes) and collection_path == _TESTS:
        return True
    return None
