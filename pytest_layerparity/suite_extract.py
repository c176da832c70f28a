"""The golden extraction tests the plugin adds (``--gpu-golden --extract``)."""
from __future__ import annotations

import pytest


def test_extract_golden(layerparity_case, layerparity_session, layerparity_record):
    """Run the reference and write this layer's golden (its whole call and its output)."""
    from .golden import GoldenError
    from .modeling import ModelError

    try:
        info = layerparity_session.extract_layer(layerparity_case)
    except (GoldenError, ModelError) as exc:
        pytest.fail(str(exc), pytrace=False)
    layerparity_record("layers", str(layerparity_case))
    layerparity_record("verdict", "written")
    for key, value in info.items():
        layerparity_record(key, value)
    assert layerparity_session.store.has(f"layer_{layerparity_case}")
