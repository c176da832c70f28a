"""The golden store: one safetensors file per entry plus ``manifest.json``.

Guarantees (see docs/how-it-works.md, "What the store guarantees"):

* every file is written to a temporary name (``.<name>.<random>.tmp``, never a name the
  manifest can list), fsynced and renamed into place; the rename and the manifest update
  happen together under the store's lock, manifest last, so a killed run or a full disk
  never leaves a half-written file that is read as a golden, and never loses an entry;
* every entry carries its sha256 and size in the manifest and is verified before use;
* tensors are read with safetensors (no unpickling); file names from the manifest cannot
  escape the store's folder (no ``..``, no absolute paths, no symlinks out, no devices);
* several processes may write different entries of one store at once.

An entry's file is read as :mod:`.entry_files` says, and checked as :mod:`.entry_checks` and
:mod:`.finite` say.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from ..compare.envelope import Envelope
from ..selection import golden_layer, parse_decode_key, parse_layer_key
from . import tensorfile
from .atomic import _fsync_dir, _write_temp, atomic_write_bytes
from .commands import extract_command
from .differences import describe_differences
from .entry_checks import check_layer_entry, check_model_logits, current_names, read_metadata
from .entry_files import GoldenError, entry_path, json_kind, read_verified, reason
from .finite import check_finite, split_nonfinite

#: The key of the whole model's golden (its compact next-token logits).
MODEL_LOGITS_KEY = "model_logits"
#: The key of the model's input ids (and decode tokens) the goldens were made from.
MODEL_IO_KEY = "model_io"
#: The manifest's field of the layers the extraction's forward did not call: ``{"1": "ItsClass"}``.
UNCALLED_KEY = "uncalled_layers"

#: 2: the precision floor of tensor ``X`` is ``floor.X``; 1 named it ``ref_X`` (read too).
SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class GoldenEntry:
    """One loaded entry: its tensors and the JSON metadata stored beside them."""

    key: str
    path: Path
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any]

    @property
    def envelope(self) -> Envelope | None:
        """The layer's noise envelope (None when extracted without one; checked on load)."""
        return Envelope.from_metadata(self.metadata.get("envelope"))

    def envelope_for(self, sixteen_bit_sums: bool) -> Envelope | None:
        """The envelope a target whose float16 matmuls may (or may not) sum in float16 is held
        to (``Envelope.for_target``); None when extracted without one."""
        envelope = self.envelope
        return envelope.for_target(sixteen_bit_sums) if envelope is not None else None


def _file_name(key: str) -> str:
    index = parse_layer_key(key)
    if index is not None:
        return f"layer_{index:05d}.safetensors"
    decode = parse_decode_key(key)
    if decode is not None:
        return f"layer_{decode[0]:05d}.decode_{decode[1]:03d}.safetensors"
    return f"{key}.safetensors"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8")


class GoldenStore:
    """A folder of golden references for one model, one dtype and one input. ``model_dir``
    (when known) goes into the commands its errors suggest."""

    def __init__(self, root: str | os.PathLike[str], model_dir: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root)
        self.model_dir = model_dir
        #: The store's extraction settings as flags, for the commands its errors suggest (set
        #: by whoever knows them: :func:`.commands.extraction_flags`).
        self.extract_flags: tuple[str, ...] = ()
        # (header, compare_keys) of this process's extraction, once begin() has run
        self._extraction: tuple[dict[str, Any], tuple[str, ...]] | None = None

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST_NAME

    def __repr__(self) -> str:
        return f"GoldenStore({str(self.root)!r})"

    # -- hints ------------------------------------------------------------------------

    def extract_command(self, key: str | None = None) -> str:
        index = golden_layer(key or "")
        return extract_command(self.root, self.model_dir, None if index is None else str(index), self.extract_flags)

    def regen_hint(self, key: str | None = None) -> str:
        """How to replace one entry (extraction rewrites it and keeps the others)."""
        return f"regenerate it with: {self.extract_command(key)}"

    def rebuild_hint(self) -> str:
        """How to start over when the manifest itself cannot be used."""
        return f"move {self.root} away (or delete it) and extract again: {self.extract_command()}"

    # -- manifest -------------------------------------------------------------------

    def peek_manifest(self) -> dict[str, Any] | None:
        """The manifest as it reads, or None where it is absent or unusable (no error: for
        what the store's own errors suggest, which :meth:`read_manifest` raises)."""
        try:
            manifest = json.loads(self.manifest_path.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            return None
        return manifest if isinstance(manifest, dict) else None

    def read_manifest(self) -> dict[str, Any] | None:
        """The manifest, or None when the store has none yet. Raises GoldenError when it
        cannot be used (unreadable, not JSON, not an object, unknown schema, no files table)."""
        path = self.manifest_path
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise GoldenError(f"{path}: cannot read the manifest ({reason(exc)}); {self.rebuild_hint()}") from exc
        try:
            manifest = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise GoldenError(f"{path}: the manifest is not valid JSON ({exc}); {self.rebuild_hint()}") from exc
        if not isinstance(manifest, dict):
            raise GoldenError(
                f"{path}: the manifest is not a JSON object (it is a {json_kind(manifest)}); {self.rebuild_hint()}"
            )
        version = manifest.get("schema_version")
        if type(version) is not int or version not in READABLE_SCHEMAS:
            raise GoldenError(
                f"{path}: schema version {version!r} is not one this pytest-layerparity reads "
                f"(it reads {', '.join(map(str, READABLE_SCHEMAS))}); {self.rebuild_hint()}"
            )
        files = manifest.get("files")
        if files is None:
            raise GoldenError(f"{path}: the manifest has no 'files' table; {self.rebuild_hint()}")
        if not isinstance(files, dict):
            raise GoldenError(
                f"{path}: the manifest's 'files' is a {json_kind(files)}, not an object of entries; "
                f"{self.rebuild_hint()}"
            )
        return manifest

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the store's lock (for writers that update the manifest)."""
        from filelock import FileLock

        self.root.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.root / ".manifest.lock")):
            yield

    def _write_manifest(self, manifest: Mapping[str, Any]) -> None:
        atomic_write_bytes(self.manifest_path, _manifest_bytes(manifest))

    def _new_manifest(self) -> dict[str, Any]:
        manifest: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "files": {}}
        if self._extraction is not None:
            manifest.update({k: v for k, v in self._extraction[0].items() if k != "files"})
        return manifest

    def begin(self, header: Mapping[str, Any], *, compare_keys: tuple[str, ...]) -> None:
        """Create the manifest, or check that an existing one describes the same extraction.

        ``compare_keys`` name the header fields that must match for entries of both runs to
        live in one store; anything else in the header is refreshed. Later ``write`` calls
        re-check them under the lock, so a concurrent extraction of something else cannot
        slip its entries under this header.
        """
        try:
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
                manifest["schema_version"] = SCHEMA_VERSION  # this run's entries name floors floor.*
                self._write_manifest(manifest)
        except OSError as exc:
            raise GoldenError(
                f"{self.manifest_path}: cannot write the manifest ({reason(exc)}); the store is unchanged; "
                f"free space or fix the folder's permissions, then run: {self.extract_command()}"
            ) from exc
        self._extraction = (dict(header), tuple(compare_keys))

    def _check_same_extraction(self, manifest: Mapping[str, Any]) -> None:
        if self._extraction is None:
            return
        header, keys = self._extraction
        differences = describe_differences(manifest, header, keys)
        if differences:
            raise GoldenError(
                f"{self.manifest_path}: another extraction wrote to this store while this one ran "
                f"({'; '.join(differences)}); use another --golden-dir, or delete {self.root} and extract again"
            )

    # -- entries --------------------------------------------------------------------

    def write(
        self,
        key: str,
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, Any],
        *,
        omit_nonfinite: bool = False,
        record_extra: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write one entry atomically and record it in the manifest (with ``record_extra``'s
        fields beside its file, sha256 and size: a layer's weights' digest).

        Raises ValueError (before writing anything) when a tensor holds NaN, or Inf in
        hidden states; with ``omit_nonfinite`` such tensors are left out instead and listed
        under ``omitted`` in the entry's metadata. Raises GoldenError when the file or the
        manifest cannot be written; the store then keeps what it had for ``key``.
        """
        metadata = dict(metadata)
        if omit_nonfinite:
            tensors, omitted = split_nonfinite(key, tensors)
            if omitted:
                metadata["omitted"] = omitted
        else:
            check_finite(key, tensors)
        name = _file_name(key)
        path = self.root / name
        written: dict[str, tuple[str, int]] = {}  # the file written from the tensors' own memory

        def fill(fd: int) -> None:
            written["file"] = tensorfile.write_tensors(
                fd, tensors, {"layerparity": json.dumps(metadata, sort_keys=True)}
            )

        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = _write_temp(path, fill)
        except OSError as exc:
            raise GoldenError(self._write_failure(key, path, exc)) from exc
        sha256, size = written["file"]
        record = {"file": name, "sha256": sha256, "bytes": size, **(record_extra or {})}
        renamed = False
        try:
            with self.locked():
                manifest = self.read_manifest() or self._new_manifest()
                self._check_same_extraction(manifest)
                manifest["files"][key] = record
                manifest_tmp = _write_temp(self.manifest_path, _manifest_bytes(manifest))
                try:
                    os.replace(tmp, path)
                    renamed = True
                    os.replace(manifest_tmp, self.manifest_path)
                finally:
                    manifest_tmp.unlink(missing_ok=True)
                _fsync_dir(self.root)
        except OSError as exc:
            if renamed:
                raise GoldenError(
                    f"{self.manifest_path}: wrote {path} but could not record it in the manifest "
                    f"({reason(exc)}); the store refuses {key} until it is extracted again: "
                    f"{self.extract_command(key)}"
                ) from exc
            raise GoldenError(self._write_failure(key, path, exc)) from exc
        finally:
            if not renamed:
                tmp.unlink(missing_ok=True)
        return path

    def _write_failure(self, key: str, path: Path, exc: OSError) -> str:
        return (
            f"{path}: cannot write the golden for {key} ({reason(exc)}); the store is unchanged "
            f"(the manifest does not list the new file; an earlier {path.name}, if any, is intact); "
            f"free space or fix the folder's permissions, then run: {self.extract_command(key)}"
        )

    def keys(self) -> list[str]:
        manifest = self.read_manifest()
        return sorted(manifest["files"]) if manifest else []

    def decode_steps(self, index: int) -> list[int]:
        """The decode steps this store holds goldens of for layer ``index``."""
        decoded = [parse_decode_key(key) for key in self.keys()]
        return sorted(d[1] for d in decoded if d is not None and d[0] == index)

    def has_decode(self) -> bool:
        """Whether the store holds decode-step goldens (of any layer)."""
        return any(parse_decode_key(key) is not None for key in self.keys())

    def uncalled_layers(self) -> dict[int, str]:
        """The layers (and their classes) the extraction's forward did not call on the golden
        input: they have no goldens, by design (a store made before it was recorded: none)."""
        manifest = self.read_manifest()
        found = manifest.get(UNCALLED_KEY) if manifest else None
        if not isinstance(found, dict):
            return {}
        return {int(k): str(v) for k, v in found.items() if isinstance(k, str) and k.isdigit()}

    def has(self, key: str) -> bool:
        manifest = self.read_manifest()
        return bool(manifest) and key in manifest["files"]

    def verifies(self, key: str) -> bool:
        """Whether ``key`` is listed and loads (sha256, format, finiteness)."""
        try:
            self.load(key)
        except GoldenError:
            return False
        return True

    def load(self, key: str, missing_hint: str | None = None) -> GoldenEntry:
        """Read and verify one entry. Raises GoldenError naming the file on any problem."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        manifest = self.read_manifest()
        if manifest is None:
            raise GoldenError(
                f"no golden store at {self.root} (no {MANIFEST_NAME}); {missing_hint or self.regen_hint()}"
            )
        record = manifest["files"].get(key)
        if record is None:
            raise GoldenError(f"{self.root}: no golden for {key}; {missing_hint or self.regen_hint(key)}")
        path, resolved = entry_path(self.root, self.manifest_path, key, record, self.rebuild_hint)
        payload = read_verified(key, path, resolved, record, lambda: self.regen_hint(key))
        try:
            tensors = current_names(load(payload))
            metadata = read_metadata(payload)
        except (SafetensorError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            raise GoldenError(f"{path}: not a readable safetensors file ({exc}); {self.regen_hint(key)}") from exc
        try:
            _check_entry(key, tensors, metadata)
            check_finite(key, tensors)
        except ValueError as exc:
            raise GoldenError(f"{path}: {exc}; {self.regen_hint(key)}") from exc
        return GoldenEntry(key=key, path=path, tensors=tensors, metadata=metadata)


def _check_entry(key: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> None:
    """The whole model's golden must hold its compact logits, a layer's its call and what the
    call names (:mod:`.entry_checks`)."""
    if key == MODEL_LOGITS_KEY:
        check_model_logits(key, tensors, metadata)
        return
    check_layer_entry(key, tensors, metadata)
