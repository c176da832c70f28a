"""Atomic file writes: a file written to a temporary name beside its destination, fsynced,
and renamed into place (its folder fsynced after), so that a reader sees the old file or the
whole new one, never part of it."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import tensorfile


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_temp(path: Path, data: bytes | Callable[[int], Any]) -> Path:
    """Write ``data`` (bytes, or a function writing to the file descriptor it is given) to
    a new temporary file beside ``path`` and fsync it; return its path. On any failure the
    temporary file is removed and the error raised."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            os.fchmod(fd, 0o666 & ~_umask())
            if callable(data):
                data(fd)
            else:
                tensorfile.write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    tmp = _write_temp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
