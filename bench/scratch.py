"""A bench's work folder, removed when the bench ends however it ends: done, failed, stopped
with Ctrl-C or a SIGTERM (a timeout). Benches write goldens and checkpoints of hundreds of MB;
left behind, a few dozen runs fill the disk."""

from __future__ import annotations

import atexit
import shutil
import signal
import sys
import tempfile
from pathlib import Path


def _stop(signum, _frame) -> None:
    sys.exit(128 + signum)  # unwinds: atexit handlers and finally blocks run


def work_folder(prefix: str, given: Path | None = None) -> Path:
    """A new temporary folder named ``prefix...``, removed at exit; or ``given`` (made where
    missing), which is the caller's and kept."""
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        return given
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, True)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _stop)
    return folder
