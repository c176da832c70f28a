"""The golden store: one safetensors file per entry plus ``manifest.json``.

Guarantees (see README, "What the store guarantees"):

* every file is written to a temporary name, fsynced and renamed into place, and the
  manifest is updated last, under a lock, so a killed run never leaves a half-written
  file that is read as a golden;
* every entry carries its sha256 in the manifest and is verified before it is used;
* tensors are read with safetensors (no unpickling), and file names from the manifest
  cannot escape the store's folder;
* several processes may write different entries of one store at once.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\.safetensors$")


class GoldenError(Exception):
    """A golden that must not be used: missing, corrupt, stale or unsafe. The message says why and what to run."""


@dataclass(frozen=True)
class GoldenEntry:
    """One loaded entry: its tensors and the JSON metadata stored beside them."""

    key: str
    path: Path
    tensors: dict[str, Any]
    metadata: dict[str, Any]


def layer_key(index: int) -> str:
    return f"layer_{index}"


def _file_name(key: str) -> str:
    match = re.fullmatch(r"layer_(\d+)", key)
    if match:
        return f"layer_{int(match.group(1)):05d}.safetensors"
    return f"{key}.safetensors"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


class GoldenStore:
    """A folder of golden references for one model, one dtype and one input."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST_NAME

    def __repr__(self) -> str:
        return f"GoldenStore({str(self.root)!r})"

    # -- manifest -------------------------------------------------------------------

    def read_manifest(self) -> dict[str, Any] | None:
        """The manifest, or None when the store has none yet."""
        path = self.manifest_path
        if not path.exists():
            return None
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise GoldenError(f"{path}: the manifest is not valid JSON ({exc}); {self.regen_hint()}") from exc
        if not isinstance(manifest, dict):
            raise GoldenError(f"{path}: the manifest is not a JSON object; {self.regen_hint()}")
        version = manifest.get("schema_version")
        if version != SCHEMA_VERSION:
            raise GoldenError(
                f"{path}: schema version {version!r} is not one this pytest-layerparity reads "
                f"(it reads {SCHEMA_VERSION}); {self.regen_hint()}"
            )
        if not isinstance(manifest.get("files"), dict):
            raise GoldenError(f"{path}: the manifest has no 'files' table; {self.regen_hint()}")
        return manifest

    def regen_hint(self) -> str:
        return f"regenerate it with: pytest --gpu-golden --extract --golden-dir={self.root}"

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the store's lock (for writers that update the manifest)."""
        from filelock import FileLock

        self.root.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.root / ".manifest.lock")):
            yield

    def _write_manifest(self, manifest: Mapping[str, Any]) -> None:
        text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
        atomic_write_bytes(self.manifest_path, text.encode("utf-8"))

    def begin(self, header: Mapping[str, Any], *, compare_keys: tuple[str, ...]) -> None:
        """Create the manifest, or check that an existing one describes the same extraction.

        ``compare_keys`` name the header fields that must match for entries of both runs to
        live in one store; anything else in the header is refreshed.
        """
        with self.locked():
            manifest = self.read_manifest()
            if manifest is None:
                manifest = {"schema_version": SCHEMA_VERSION, "files": {}}
            else:
                differences = describe_differences(manifest, header, compare_keys)
                if differences and manifest["files"]:
                    raise GoldenError(
                        f"{self.manifest_path}: this store holds goldens of another extraction "
                        f"({'; '.join(differences)}); use another --golden-dir, or delete {self.root} "
                        "and extract again"
                    )
            manifest.update({key: value for key, value in header.items() if key != "files"})
            self._write_manifest(manifest)

    # -- entries --------------------------------------------------------------------

    def write(self, key: str, tensors: Mapping[str, Any], metadata: Mapping[str, Any]) -> Path:
        """Write one entry atomically and record it in the manifest."""
        from safetensors.torch import save

        check_finite(key, tensors)
        self.root.mkdir(parents=True, exist_ok=True)
        name = _file_name(key)
        payload = save(
            {name_: tensor.detach().contiguous().cpu() for name_, tensor in tensors.items()},
            metadata={"layerparity": json.dumps(dict(metadata), sort_keys=True)},
        )
        path = self.root / name
        atomic_write_bytes(path, payload)
        digest = hashlib.sha256(payload).hexdigest()
        with self.locked():
            manifest = self.read_manifest() or {"schema_version": SCHEMA_VERSION, "files": {}}
            manifest["files"][key] = {"file": name, "sha256": digest, "bytes": len(payload)}
            self._write_manifest(manifest)
        return path

    def keys(self) -> list[str]:
        manifest = self.read_manifest()
        return sorted(manifest["files"]) if manifest else []

    def has(self, key: str) -> bool:
        manifest = self.read_manifest()
        return bool(manifest) and key in manifest["files"]

    def _entry_path(self, key: str, record: Any) -> Path:
        name = record.get("file") if isinstance(record, dict) else None
        if not isinstance(name, str) or not _SAFE_NAME.match(name) or "/" in name or "\\" in name:
            raise GoldenError(
                f"{self.manifest_path}: entry {key!r} names file {name!r}, which is not a plain "
                "safetensors file name inside the store; refusing to read it"
            )
        path = (self.root / name).resolve()
        if path.parent != self.root.resolve():
            raise GoldenError(f"{self.manifest_path}: entry {key!r} points outside the store ({name!r})")
        return path

    def load(self, key: str, missing_hint: str | None = None) -> GoldenEntry:
        """Read and verify one entry. Raises GoldenError naming the file on any problem."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        manifest = self.read_manifest()
        if manifest is None:
            raise GoldenError(
                f"no golden store at {self.root} (no {MANIFEST_NAME}); "
                f"{missing_hint or self.regen_hint()}"
            )
        record = manifest["files"].get(key)
        if record is None:
            raise GoldenError(f"{self.root}: no golden for {key}; {missing_hint or self.regen_hint()}")
        path = self._entry_path(key, record)
        try:
            payload = path.read_bytes()
        except OSError as exc:
            raise GoldenError(f"{path}: cannot read the golden for {key} ({exc}); {self.regen_hint()}") from exc
        digest = hashlib.sha256(payload).hexdigest()
        if digest != record.get("sha256"):
            raise GoldenError(
                f"{path}: sha256 {digest[:16]}... does not match the manifest's "
                f"{str(record.get('sha256'))[:16]}... (the file is corrupt or was changed); {self.regen_hint()}"
            )
        try:
            tensors = load(payload)
            metadata = _read_metadata(payload)
        except (SafetensorError, ValueError) as exc:
            raise GoldenError(f"{path}: not a readable safetensors file ({exc}); {self.regen_hint()}") from exc
        try:
            check_finite(key, tensors)
        except ValueError as exc:
            raise GoldenError(f"{path}: {exc}; {self.regen_hint()}") from exc
        return GoldenEntry(key=key, path=path, tensors=tensors, metadata=metadata)


def _read_metadata(payload: bytes) -> dict[str, Any]:
    if len(payload) < 8:
        raise ValueError("file too short")
    header_len = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + header_len])
    raw = (header.get("__metadata__") or {}).get("layerparity")
    return json.loads(raw) if raw else {}


def check_finite(key: str, tensors: Mapping[str, Any]) -> None:
    """Refuse NaN anywhere and Inf in hidden states (masks may hold -inf legitimately)."""
    import torch

    for name, tensor in tensors.items():
        if not torch.is_floating_point(tensor):
            continue
        nan = torch.isnan(tensor)
        if bool(nan.any()):
            index = tuple(int(i) for i in torch.nonzero(nan)[0])
            raise ValueError(f"{key}: tensor {name!r} holds NaN (first at index {index})")
        if _is_hidden_state(name):
            inf = torch.isinf(tensor)
            if bool(inf.any()):
                index = tuple(int(i) for i in torch.nonzero(inf)[0])
                raise ValueError(f"{key}: tensor {name!r} holds Inf (first at index {index})")


def _is_hidden_state(name: str) -> bool:
    return name.startswith(("output", "args.0", "fp32_output")) or name in {"embeddings", "logits"}


def describe_differences(manifest: Mapping[str, Any], expected: Mapping[str, Any], keys: tuple[str, ...]) -> list[str]:
    """Human-readable differences between a manifest and what this run expects."""
    out = []
    for key in keys:
        have, want = _dig(manifest, key), _dig(expected, key)
        if have != want and not (_is_nan(have) and _is_nan(want)):
            out.append(f"{key}: store has {have!r}, this run has {want!r}")
    return out


def _dig(mapping: Mapping[str, Any], dotted: str) -> Any:
    value: Any = mapping
    for part in dotted.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)
