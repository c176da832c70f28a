"""report.html looked at in a real headless browser (Chromium, from the npm registry:
``npm install --prefix tests/browser``, which ``.ci/run`` does). Run with ``pytest tests/browser``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    if shutil.which("node") is None:
        raise pytest.UsageError("tests/browser drives Chromium from Node.js: install node (18 or newer)")
    if not (HERE / "node_modules" / "@sparticuz" / "chromium").is_dir():
        raise pytest.UsageError("tests/browser needs its browser: npm install --prefix tests/browser")
