"""pytest-layerparity: per-decoder-layer parity tests for LLM ports.

The pytest glue lives in :mod:`pytest_layerparity.plugin`; everything else is plain
Python that can be used without pytest (the golden store, the metrics, the capture).
"""

from __future__ import annotations

__version__ = "0.1.0"
