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

import contextlib
import math
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Hashable, Iterator, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..store.callspec import CallRecord
from ..store.kv_cache import UnstorableCache, cached_kv, find_kv_cache, seen_tokens

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


def mapped_empty(parent: Path, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory is a file under ``parent``, mapped shared and
    removed at once (the mapping keeps it until the tensor is freed): its pages are the
    file's, which the kernel writes out and takes back when memory runs short, instead of
    the process's own memory. For a result larger than a layer's activations that the run
    only writes and reads back once (the prompt's logits, seq x vocab)."""
    parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", suffix=".map", dir=parent)
    os.close(handle)
    try:
        flat = torch.from_file(name, shared=True, size=math.prod(shape), dtype=dtype)
    finally:
        os.unlink(name)
    return flat.view(*shape)


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
        self._made = 0  # files made so far: each gets a name of its own, whatever was deleted

    @property
    def folder(self) -> Path:
        if self._folder is None:
            self._parent.mkdir(parents=True, exist_ok=True)
            remove_orphans(self._parent)
            self._folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=self._parent))
            weakref.finalize(self, shutil.rmtree, str(self._folder), True)
        return self._folder

    def __setitem__(self, key: Hashable, record: CallRecord) -> None:
        from ..store.tensorfile import save_tensors

        path = self.folder / f"{self._made:05d}.safetensors"
        self._made += 1
        save_tensors(path, record.tensors)  # from the tensors' own memory (views of one storage too)
        if key in self._specs:
            self._specs[key][1].unlink(missing_ok=True)
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


class SpilledKV:
    """The decode steps' KV cache, one layer in memory at a time: after layer ``i`` runs,
    its keys and values go to a file and the cache keeps a weightless stand-in of their
    shape (a "meta" tensor, so the cache still answers its length; a read of it raises); just
    before layer ``i`` runs again they are read back. Without it the cache of every layer is
    held through the decode steps (it grows with depth: 67 MB at seq 2048 for 16 layers of
    8 key/value heads of 64 in bfloat16). The entries spilled after layer ``i`` are those its
    call appended to (entry ``i``, or each of a layer's attention blocks' own); a cache entry
    without keys and values tensors (linear attention's states) is left where it is."""

    def __init__(self, parent: Path) -> None:
        self._files = SpilledCalls(parent)
        self._before: dict[int, list[int]] = {}  # each running layer's cache entries' token counts

    @contextlib.contextmanager
    def hooks(self, layer_list: Sequence[torch.nn.Module]) -> Iterator[None]:
        """Spill and restore around each layer's call while the block runs: the restore runs
        before any other hook of the layer, the spill after those registered before it
        (enter this after the capture's hooks)."""
        handles = []
        try:
            for i, layer in enumerate(layer_list):
                handles.append(layer.register_forward_pre_hook(self._restore_hook(i), with_kwargs=True, prepend=True))
                handles.append(layer.register_forward_hook(self._spill_hook(i), with_kwargs=True))
            yield
        finally:
            for handle in handles:
                handle.remove()

    def close(self) -> None:
        """Remove the files (the cache they belong to is dropped)."""
        self._files.clear()

    def _restore_hook(self, i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            cache = find_kv_cache([args, kwargs])
            if cache is None:
                return
            if i in self._files:
                record = self._files[i]
                device = record.spec["device"]
                for j in record.spec["entries"]:
                    entry = cache.layers[j]
                    entry.keys = record.tensors[f"keys.{j}"].to(device)
                    entry.values = record.tensors[f"values.{j}"].to(device)
                del self._files[i]
            self._before[i] = [_seen(cache, j) for j in range(len(cache.layers))]

        return hook

    def _spill_hook(self, i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            cache = find_kv_cache([args, kwargs])
            before = self._before.pop(i, [])
            if cache is None:
                return
            appended = [j for j in range(len(cache.layers)) if _seen(cache, j) > (before[j] if j < len(before) else 0)]
            tensors: dict[str, torch.Tensor] = {}
            entries = []
            for j in appended or [i]:
                kv = cached_kv(cache, j)
                if kv is None or kv[0].device.type == "meta":
                    continue
                tensors[f"keys.{j}"], tensors[f"values.{j}"] = kv
                entries.append(j)
            if not entries:
                return
            device = str(tensors[f"keys.{entries[0]}"].device)
            self._files[i] = CallRecord(tensors=tensors, spec={"device": device, "entries": entries})
            for j in entries:
                entry, (keys, values) = cache.layers[j], (tensors[f"keys.{j}"], tensors[f"values.{j}"])
                entry.keys = torch.empty(keys.shape, dtype=keys.dtype, device="meta")
                entry.values = torch.empty(values.shape, dtype=values.dtype, device="meta")

        return hook


def _seen(cache: Any, layer: int) -> int:
    """How many tokens entry ``layer`` of ``cache`` has been given (0 for one that is no
    store of keys and values: linear attention's states stay in memory, a few per layer;
    capture refuses the other kinds)."""
    try:
        return seen_tokens(cache, layer)
    except UnstorableCache:
        return 0
