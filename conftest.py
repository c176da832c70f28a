"""The project's own test configuration.

With a layerparity mode on (``pytest --xla``, ``pytest --gpu-golden --extract``) and no test
paths given, this repository runs the plugin's tests on the embedded default model and not
its own suite (``testpaths``).
"""

from __future__ import annotations

import pytest

_MODES = ("layerparity_gpu_golden", "layerparity_xla", "layerparity_neuron", "layerparity_target")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if (
        any(config.getoption(name, None) for name in _MODES)
        and config.args_source == pytest.Config.ArgsSource.TESTPATHS
    ):
        config.args[:] = []
