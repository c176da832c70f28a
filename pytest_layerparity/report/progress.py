"""Progress of long work inside one test (the reference forward pass over every layer, the
noise envelope's perturbed runs, a chained run): a tqdm bar written to the terminal past
pytest's output capture, quiet under ``-q``, on xdist workers and when stderr is no
terminal."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from tqdm import tqdm


class TerminalStream:
    """A file-like object that writes to the terminal with pytest's capture suspended for
    the write (``suspend`` is the capture manager's ``global_and_fixture_disabled``)."""

    def __init__(self, suspend: Callable[[], Any]) -> None:
        self.suspend = suspend

    def write(self, text: str) -> int:
        with self.suspend():
            sys.stderr.write(text)
            sys.stderr.flush()
        return len(text)

    def flush(self) -> None:
        pass


class Progress:
    """Makes bars; ``enabled`` False makes silent ones (tqdm's ``disable``)."""

    def __init__(self, enabled: bool = False, stream: Any = None) -> None:
        self.enabled = enabled
        self.stream = stream

    def bar(self, total: int, desc: str, unit: str = "layer") -> tqdm:
        return tqdm(
            total=total,
            desc=desc,
            unit=unit,
            file=self.stream,
            disable=not self.enabled,
            leave=False,
            dynamic_ncols=True,
        )


#: Bars that show nothing (scripts, tests, workers).
SILENT = Progress(False)


def for_pytest(config: Any) -> Progress:
    """The progress of a pytest session: shown on the controller (or a run without xdist),
    at normal verbosity or more, when stderr is a terminal."""
    capman = config.pluginmanager.getplugin("capturemanager")
    enabled = (
        not hasattr(config, "workerinput")
        and config.get_verbosity() >= 0
        and sys.stderr.isatty()
        and capman is not None
    )
    if not enabled:
        return SILENT
    return Progress(True, TerminalStream(capman.global_and_fixture_disabled))
