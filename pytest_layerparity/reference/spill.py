"""Captured calls kept on disk until a golden is written from them.

A reference run captures every selected layer's call (hidden states in and out, masks,
rotary tensors, and for decode steps the layer's past keys and values) before the first
golden is written; held in memory that grows with depth (at seq 4096 and hidden 6144 a
layer's input and output alone are 100 MB in bfloat16). Each call is written to a
safetensors file of its own as it is captured, beside the goldens, and read back when its
golden is written: the run holds one call at a time, whatever the depth. The folder is
removed when its last call is written, when the run is dropped, or at exit; one left by a
process that was killed is removed by the next run that spills there."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Hashable, Iterator, MutableMapping
from pathlib import Path

import torch

from ..store.callspec import CallRecord

PREFIX = ".layerparity-calls-"


def remove_orphans(parent: Path) -> list[Path]:
    """Remove spill folders under ``parent`` whose process is gone (killed before it could);
    those of live processes (other xdist workers) are left. Returns what was removed."""
    removed = []
    for folder in parent.glob(f"{PREFIX}*"):
        pid = folder.name[len(PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class SpilledCalls(MutableMapping[Hashable, CallRecord]):
    """A mapping of captured calls whose tensors live in files under ``parent`` (created on
    the first call). ``add(key, tensors)`` attaches small tensors found after the call was
    captured (its routers' choices), kept in memory and merged when the call is read."""

    def __init__(self, parent: Path) -> None:
        self._parent = Path(parent)
        self._folder: Path | None = None
        self._specs: dict[Hashable, tuple[dict, Path]] = {}
        self._extra: dict[Hashable, dict[str, torch.Tensor]] = {}

    @property
    def folder(self) -> Path:
        if self._folder is None:
            self._parent.mkdir(parents=True, exist_ok=True)
            remove_orphans(self._parent)
            self._folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=self._parent))
            weakref.finalize(self, shutil.rmtree, str(self._folder), True)
        return self._folder

    def __setitem__(self, key: Hashable, record: CallRecord) -> None:
        from safetensors.torch import save_file

        path = self.folder / f"{len(self._specs):05d}.safetensors"
        save_file({name: t.detach().contiguous().clone() for name, t in record.tensors.items()}, str(path))
        self._specs[key] = (record.spec, path)

    def add(self, key: Hashable, tensors: dict[str, torch.Tensor]) -> None:
        if key in self._specs:
            self._extra.setdefault(key, {}).update(tensors)

    def __getitem__(self, key: Hashable) -> CallRecord:
        from safetensors.torch import load_file

        spec, path = self._specs[key]
        tensors = load_file(str(path))
        tensors.update(self._extra.get(key, {}))
        return CallRecord(tensors=tensors, spec=spec)

    def __delitem__(self, key: Hashable) -> None:
        _, path = self._specs.pop(key)
        self._extra.pop(key, None)
        path.unlink(missing_ok=True)
        if not self._specs and self._folder is not None:  # the last one: the folder goes too
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)
