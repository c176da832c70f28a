"""A failing port held beside a same-device control: the model's own layer (from the
checkpoint; no hook, no port), or for the whole-model test the model's own transformers model,
run on the same device with the same golden call and judged the same way. Where the control
passes, the difference is the port's; where it fails too, the device's arithmetic leaves the
envelope whatever runs there, and the port's failure says less about the port."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..compare.judge import LayerOutcome
    from ..compare.verdict import Check
    from ..session import LayerParitySession
    from ..store.golden import GoldenEntry


#: What a failure of the model's own layer (no port, no hook) says in place of a control.
OWN_LAYER_NOTE = (
    "  the layer under test is the model's own transformers layer (no port): what differs is how this device "
    "runs it (its kernels or its compiler)"
)


def recorded(record: Callable[[str, object], None], found: tuple[str, bool | None]) -> str:
    """The line of a control ``found`` (:func:`control_note`, :func:`model_control_note`), its
    verdict recorded (JUnit ``control_passed``) where it ran."""
    line, passed = found
    if passed is not None:
        record("control_passed", passed)
    return line


def _failing(checks: Iterable[Check]) -> str:
    return ", ".join(f"{c.name} {c.value:.3g}" for c in checks if not c.ok)


def _held_beside(
    session: LayerParitySession, what: str, same: str, run: Callable[[], str | None]
) -> tuple[str, bool | None]:
    """(the failure text's line, whether the control passed) for the control ``what`` on
    ``same``: ``run()`` runs and judges it, returning None where it passes, else its failing
    checks; None for a control that did not run."""
    where = session.backend.describe()
    if session.target.compiled:
        return f"  control: not run for a compiled port ({what} would be a program of its own to compile)", None
    try:
        failing = run()
    except Exception as exc:  # the model's own layers may not run where the port does
        return f"  control: {what} could not run on {where}: {type(exc).__name__}: {exc}", None
    if failing is None:
        return f"  control: {what} on {where}, on {same}, passes: the difference is the port's", True
    return (
        f"  control: {what} on {where}, on {same}, fails too ({failing}): the device's arithmetic leaves the "
        "envelope whatever runs there, so this failure says less about the port",
        False,
    )


def control_note(
    session: LayerParitySession, index: int, steps: list[int] | None = None, failed: Sequence[LayerOutcome] = ()
) -> tuple[str, bool | None]:
    """The control of layer ``index``'s prompt test, or with ``steps`` its decode steps (see
    :func:`_held_beside`); (:data:`OWN_LAYER_NOTE`, None) where the layer under test was the
    model's own, no port or hook having made it (nothing to hold it beside). A hook that
    returned the model's layer unchanged gets a control that fails as it did: which is what
    it says (the device, not the port). ``failed``: the failing outcomes, whose controls are
    taken where each already ran to draw its limits (``TargetSide.judge_port``)."""
    target = session.target
    if not target.ported:
        return OWN_LAYER_NOTE, None

    def run() -> str | None:
        ran = [o.control for o in failed if o.control is not None]
        if ran and len(ran) == len(failed):
            outcomes = ran
        elif steps is None:
            outcomes = [target.parity_layer(index, control=True)]
        else:
            outcomes = target.parity_decode(index, steps, control=True)
        failing = [o for o in outcomes if not o.passed]
        return _failing(failing[0].checks) if failing else None

    same = "the same call" if steps is None else f"the same decode step{'s' if len(steps) > 1 else ''}"
    return _held_beside(session, "the model's own layer", same, run)


def model_control_note(session: LayerParitySession, entry: GoldenEntry) -> tuple[str, bool | None]:
    """The control of the whole-model test: the model's own transformers model, every layer
    its own (see :func:`_held_beside`); ("", None) where no port or hook made any of it."""
    target = session.target
    if not target.ported and target.build_model_hook is None:
        return "", None

    def run() -> str | None:
        outcome = target.parity_model(entry, control=True)
        return None if outcome.passed else _failing(outcome.checks)

    return _held_beside(session, "the model's own transformers model", "the same tokens", run)
