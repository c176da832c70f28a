"""An entry's file in the golden store (:mod:`.golden`), read only as the manifest names it: a
plain safetensors file inside the store's folder (no ``..``, no absolute paths, no symlinks
out, no devices) whose size and sha256 are the manifest's."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


class GoldenError(Exception):
    """A golden that must not be used: missing, corrupt, stale or unsafe. The message says why and what to run."""


SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\.safetensors$")


def reason(exc: OSError) -> str:
    if exc.errno and exc.strerror:
        return f"{exc.strerror} [{errno.errorcode.get(exc.errno, exc.errno)}]"
    return str(exc) or type(exc).__name__


def json_kind(value: Any) -> str:
    for kind, name in ((bool, "boolean"), (dict, "object"), (list, "list"), (str, "string"), ((int, float), "number")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


def entry_path(
    root: Path, manifest_path: Path, key: str, record: Any, rebuild_hint: Callable[[], str]
) -> tuple[Path, Path]:
    """(the entry's path as named in messages, its resolved path inside the store ``root``)."""
    if not isinstance(record, dict):
        raise GoldenError(
            f"{manifest_path}: entry {key!r} is a {json_kind(record)}, not an object with "
            f"file, sha256 and bytes; {rebuild_hint()}"
        )
    name = record.get("file")
    if not isinstance(name, str) or not SAFE_NAME.match(name) or "/" in name or "\\" in name:
        raise GoldenError(
            f"{manifest_path}: entry {key!r} names file {name!r}, which is not a plain "
            "safetensors file name inside the store; refusing to read it"
        )
    path = root / name
    try:
        resolved = path.resolve()
        root = root.resolve()
    except (OSError, RuntimeError) as exc:
        raise GoldenError(f"{path}: cannot resolve the golden's path ({exc}); refusing to read it") from exc
    if resolved.parent != root:
        raise GoldenError(
            f"{manifest_path}: entry {key!r} points outside the store ({name!r} leads to {resolved}); "
            "refusing to read it"
        )
    return path, resolved


def read_verified(
    key: str, path: Path, resolved: Path, record: Mapping[str, Any], regen_hint: Callable[[], str]
) -> bytes:
    """The file's bytes, after checking it is a regular file whose size and sha256 are
    the manifest's (a file of another size is hashed in blocks, never held whole)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    want_sha = record.get("sha256")
    want_bytes = record.get("bytes")
    try:
        fd = os.open(resolved, flags)
    except OSError as exc:
        raise GoldenError(f"{path}: cannot read the golden for {key} ({reason(exc)}); {regen_hint()}") from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise GoldenError(f"{path}: not a regular file; refusing to read it as the golden for {key}; {regen_hint()}")
    with os.fdopen(fd, "rb") as handle:
        size_differs = type(want_bytes) is int and info.st_size != want_bytes
        digest = hashlib.sha256()
        payload = b""
        try:
            if size_differs:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
            else:
                payload = handle.read()
                digest.update(payload)
        except OSError as exc:
            raise GoldenError(f"{path}: cannot read the golden for {key} ({reason(exc)}); {regen_hint()}") from exc
    have_sha = digest.hexdigest()
    if have_sha != want_sha:
        size_note = f": {info.st_size} bytes, the manifest says {want_bytes}" if size_differs else ""
        raise GoldenError(
            f"{path}: sha256 {have_sha[:16]}... does not match the manifest's "
            f"{str(want_sha)[:16]}... (the file is corrupt or was changed{size_note}); {regen_hint()}"
        )
    if size_differs:
        raise GoldenError(f"{path}: {info.st_size} bytes, the manifest says {want_bytes}; {regen_hint()}")
    return payload
