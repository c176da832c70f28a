from __future__ import annotations

import pytest

from pytest_layerparity.backends import BackendUnavailable
from pytest_layerparity.backends.install import check_transformers_version


@pytest.mark.parametrize("version", ["5.16.0", "5.16.1", "5.24.0", "5.40.0.dev0", "6.0.0", "4.57.6"])
def test_supported_transformers_releases_pass(version):
    check_transformers_version(version)


@pytest.mark.parametrize("version", ["5.0.0", "5.15.1", "5.5.0rc1"])
def test_an_older_transformers_5_is_refused_with_the_install_command(version):
    with pytest.raises(BackendUnavailable) as excinfo:
        check_transformers_version(version)
    assert str(excinfo.value) == (
        f"transformers {version} is older than 5.16, the oldest 5.x release the plugin supports "
        "(its checkpoint loader changed); pip install -U 'transformers>=5.16'"
    )


def test_the_extras_ask_for_the_oldest_supported_transformers():
    import re
    from pathlib import Path

    import tomllib

    from pytest_layerparity.backends.install import OLDEST_TRANSFORMERS_5

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    bounds = {
        name: [r for r in requirements if re.match(r"transformers\b", r)] for name, requirements in extras.items()
    }
    oldest = ".".join(map(str, OLDEST_TRANSFORMERS_5))
    for name in ("reference", "xla", "test"):
        assert bounds[name] == [f"transformers>={oldest}"], name  # no cap above: the newest release is tested
    assert bounds["nxdi"] == ["transformers==4.57.*"]  # what NxDI pins
