"""The project's own tests: ``unit/`` (pure modules, no model, seconds) and ``e2e/`` (the
plugin as a user runs it, on the embedded model and torch-xla's CPU device)."""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
