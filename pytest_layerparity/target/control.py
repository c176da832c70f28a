"""A failing port held beside a same-device control: the model's own layer (from the
checkpoint; no hook, no port) run on the same device with the same golden call and judged the
same way. Where the control passes, the difference is the port's; where it fails too, the
device's arithmetic leaves this layer's envelope whatever runs there, and the port's failure
says less about the port."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..compare.judge import LayerOutcome
    from ..session import LayerParitySession


def _failing(outcome: LayerOutcome) -> str:
    return ", ".join(f"{c.name} {c.value:.3g}" for c in outcome.checks if not c.ok)


def control_note(session: LayerParitySession, index: int, steps: list[int] | None = None) -> tuple[str, bool | None]:
    """(the failure text's line on the control, whether the control passed) for layer
    ``index``'s prompt test, or with ``steps`` its decode steps; ("", None) where the layer
    under test was the model's own, no port or hook having made it (nothing to hold it
    beside), and None for a control that did not run (a compiled port's, or one that raised).
    A hook that returned the model's layer unchanged gets a control that fails as it did:
    which is what it says (the device, not the port)."""
    target = session.target
    if index not in target.ported:
        return "", None
    where = session.backend.describe()
    if session.port is not None and session.port.compiled is not None:
        return (
            "  control: not run for a compiled port (the model's own layer would be a program of its own to compile)",
            None,
        )
    try:
        outcomes = (
            [target.parity_layer(index, control=True)]
            if steps is None
            else target.parity_decode(index, steps, control=True)
        )
    except Exception as exc:  # the model's own layer may not run where the port does
        return f"  control: the model's own layer could not run on {where}: {type(exc).__name__}: {exc}", None
    failed = [o for o in outcomes if not o.passed]
    same = "the same call" if steps is None else f"the same decode step{'s' if len(steps) > 1 else ''}"
    if not failed:
        return (
            f"  control: the model's own layer on {where}, on {same}, passes: the difference is the port's",
            True,
        )
    return (
        f"  control: the model's own layer on {where}, on {same}, fails too ({_failing(failed[0])}): the device's "
        "arithmetic leaves this layer's envelope whatever runs there, so this failure says less about the port",
        False,
    )
