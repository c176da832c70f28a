"""The text of a failing test, one writer for every suite: what failed and where, the command
to run next, then what was learnt beside it (the same-device control, the same test
unsharded)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..report.text import failure_text

if TYPE_CHECKING:
    from ..compare.judge import LayerOutcome
    from ..session import LayerParitySession


def rerun_command(session: LayerParitySession, layer: int, test: str | None = None) -> str:
    """The command that runs layer ``layer``'s tests again on the target, op by op, or with
    ``test`` (a test function's name) that test alone."""
    keyword = f"layer_{layer}" if test is None else f"{test} and layer_{layer}"
    return session.commands.rerun(str(layer), keyword)


def failing_text(
    session: LayerParitySession,
    failures: Sequence[tuple[LayerOutcome, str]] | str,
    next_command: str = "",
    *,
    head: str = "",
    control: str = "",
    unsharded: tuple[int, str] | None = None,
) -> str:
    """A failing test's text: ``head``, then each failing outcome (with where it failed) and
    ``next_command`` (or ``failures`` as written, for a text of its own); ``control``'s line
    where one was found (:func:`.control.recorded`); and where the port is sharded, what the
    same test (``unsharded``: the layer and the test function's name) says run unsharded."""
    if isinstance(failures, str):
        text = failures
    else:
        text = "\n".join(failure_text(outcome, where, next_command) for outcome, where in failures)
    text = head + text
    if control:
        text += "\n" + control
    if unsharded is not None and session.port is not None and session.port.sharded:
        from .unsharded import unsharded_note

        layer, test = unsharded
        text += "\n" + unsharded_note(session, layer, f"{test} and layer_{layer}")
    return text
