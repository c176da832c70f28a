"""The golden extraction tests the plugin adds (``--gpu-golden --extract``)."""

from __future__ import annotations

import pytest

CASES = "layers"


def test_extract_golden(layerparity_case, layerparity_session, layerparity_record, request):
    """Run the reference and write this layer's golden (its whole call and its output)."""
    from ..errors import ModelError
    from ..reference.extract import UncalledLayer
    from ..reference.overflow import ReferenceOverflow
    from ..selection import layer_key
    from ..store.golden import GoldenError

    session = layerparity_session
    failure = None  # failed outside the except blocks, so that the message is printed once
    try:
        info = session.extract_layer(layerparity_case)
    except UncalledLayer as exc:
        layerparity_record("layers", str(layerparity_case))
        layerparity_record("verdict", "skipped")
        pytest.skip(str(exc))
    except ReferenceOverflow as exc:
        # the reference's own output, the same for every layer: said once, and the run stops
        # (no layer is written; xdist's other workers stop too)
        request.session.shouldfail = (
            f"layerparity: the reference overflows in {session.golden_dtype_name}; nothing written"
        )
        failure = str(exc)
    except (GoldenError, ModelError) as exc:
        failure = str(exc)
    except OSError as exc:
        # the store turns its own write failures into GoldenError; this is anything else
        # (the model folder, a cache, the lock file) that could not be read or written
        where = f"{exc.filename}: " if exc.filename else ""
        failure = (
            f"layer {layerparity_case}: {where}{exc.strerror or exc}; nothing was recorded for this layer; "
            f"fix that, then run: {session.commands.extract(str(layerparity_case))}"
        )
    if failure is not None:
        pytest.fail(failure, pytrace=False)
    layerparity_record("layers", str(layerparity_case))
    layerparity_record("placement", session.reference.placement_summary())
    layerparity_record("verdict", "written")
    for key, value in info.items():
        layerparity_record(key, value)
    assert session.store.has(layer_key(layerparity_case))
