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

Long because :class:`GoldenStore` keeps the writes and the verified reads the guarantees rest on together.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from ..compare.envelope import Envelope
from ..compare.floor import FLOOR_KEY, FLOOR_PREFIX
from ..selection import golden_layer, parse_decode_key, parse_layer_key
from . import tensorfile
from .atomic import _fsync_dir, _write_temp, atomic_write_bytes
from .callspec import tensor_names
from .commands import extract_command
from .differences import describe_differences

#: The key of the whole model's golden (its compact next-token logits).
MODEL_LOGITS_KEY = "model_logits"
#: The key of the model's input ids (and decode tokens) the goldens were made from.
MODEL_IO_KEY = "model_io"
#: The manifest's field of the layers the extraction's forward did not call: ``{"1": "ItsClass"}``.
UNCALLED_KEY = "uncalled_layers"

#: 2: the precision floor of tensor ``X`` is ``floor.X``; 1 named it ``ref_X`` (read too).
SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)
_LEGACY_FLOOR_PREFIX = "ref_"
MANIFEST_NAME = "manifest.json"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\.safetensors$")


class GoldenError(Exception):
    """A golden that must not be used: missing, corrupt, stale or unsafe. The message says why and what to run."""


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


def _reason(exc: OSError) -> str:
    if exc.errno and exc.strerror:
        return f"{exc.strerror} [{errno.errorcode.get(exc.errno, exc.errno)}]"
    return str(exc) or type(exc).__name__


def _json_kind(value: Any) -> str:
    for kind, name in ((bool, "boolean"), (dict, "object"), (list, "list"), (str, "string"), ((int, float), "number")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


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
            raise GoldenError(f"{path}: cannot read the manifest ({_reason(exc)}); {self.rebuild_hint()}") from exc
        try:
            manifest = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise GoldenError(f"{path}: the manifest is not valid JSON ({exc}); {self.rebuild_hint()}") from exc
        if not isinstance(manifest, dict):
            raise GoldenError(
                f"{path}: the manifest is not a JSON object (it is a {_json_kind(manifest)}); {self.rebuild_hint()}"
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
                f"{path}: the manifest's 'files' is a {_json_kind(files)}, not an object of entries; "
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
                f"{self.manifest_path}: cannot write the manifest ({_reason(exc)}); the store is unchanged; "
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
            tensors, omitted = _split_nonfinite(key, tensors)
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
                    f"({_reason(exc)}); the store refuses {key} until it is extracted again: "
                    f"{self.extract_command(key)}"
                ) from exc
            raise GoldenError(self._write_failure(key, path, exc)) from exc
        finally:
            if not renamed:
                tmp.unlink(missing_ok=True)
        return path

    def _write_failure(self, key: str, path: Path, exc: OSError) -> str:
        return (
            f"{path}: cannot write the golden for {key} ({_reason(exc)}); the store is unchanged "
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

    def _entry_path(self, key: str, record: Any) -> tuple[Path, Path]:
        """(the entry's path as named in messages, its resolved path inside the store)."""
        if not isinstance(record, dict):
            raise GoldenError(
                f"{self.manifest_path}: entry {key!r} is a {_json_kind(record)}, not an object with "
                f"file, sha256 and bytes; {self.rebuild_hint()}"
            )
        name = record.get("file")
        if not isinstance(name, str) or not _SAFE_NAME.match(name) or "/" in name or "\\" in name:
            raise GoldenError(
                f"{self.manifest_path}: entry {key!r} names file {name!r}, which is not a plain "
                "safetensors file name inside the store; refusing to read it"
            )
        path = self.root / name
        try:
            resolved = path.resolve()
            root = self.root.resolve()
        except (OSError, RuntimeError) as exc:
            raise GoldenError(f"{path}: cannot resolve the golden's path ({exc}); refusing to read it") from exc
        if resolved.parent != root:
            raise GoldenError(
                f"{self.manifest_path}: entry {key!r} points outside the store ({name!r} leads to {resolved}); "
                "refusing to read it"
            )
        return path, resolved

    def _read_verified(self, key: str, path: Path, resolved: Path, record: Mapping[str, Any]) -> bytes:
        """The file's bytes, after checking it is a regular file whose size and sha256 are
        the manifest's (a file of another size is hashed in blocks, never held whole)."""
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        want_sha = record.get("sha256")
        want_bytes = record.get("bytes")
        try:
            fd = os.open(resolved, flags)
        except OSError as exc:
            raise GoldenError(
                f"{path}: cannot read the golden for {key} ({_reason(exc)}); {self.regen_hint(key)}"
            ) from exc
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise GoldenError(
                f"{path}: not a regular file; refusing to read it as the golden for {key}; {self.regen_hint(key)}"
            )
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
                raise GoldenError(
                    f"{path}: cannot read the golden for {key} ({_reason(exc)}); {self.regen_hint(key)}"
                ) from exc
        have_sha = digest.hexdigest()
        if have_sha != want_sha:
            size_note = f": {info.st_size} bytes, the manifest says {want_bytes}" if size_differs else ""
            raise GoldenError(
                f"{path}: sha256 {have_sha[:16]}... does not match the manifest's "
                f"{str(want_sha)[:16]}... (the file is corrupt or was changed{size_note}); {self.regen_hint(key)}"
            )
        if size_differs:
            raise GoldenError(f"{path}: {info.st_size} bytes, the manifest says {want_bytes}; {self.regen_hint(key)}")
        return payload

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
        path, resolved = self._entry_path(key, record)
        payload = self._read_verified(key, path, resolved, record)
        try:
            tensors = _current_names(load(payload))
            metadata = _read_metadata(payload)
        except (SafetensorError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            raise GoldenError(f"{path}: not a readable safetensors file ({exc}); {self.regen_hint(key)}") from exc
        try:
            _check_entry(key, tensors, metadata)
            check_finite(key, tensors)
        except ValueError as exc:
            raise GoldenError(f"{path}: {exc}; {self.regen_hint(key)}") from exc
        return GoldenEntry(key=key, path=path, tensors=tensors, metadata=metadata)


def _current_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An entry's tensors under this schema's names: a floor written as ``ref_X`` (schema 1,
    and entries of schema 1 in a store extracted into again) is ``floor.X``."""
    if not any(name.startswith(_LEGACY_FLOOR_PREFIX) for name in tensors):
        return tensors
    return {
        FLOOR_PREFIX + name.removeprefix(_LEGACY_FLOOR_PREFIX) if name.startswith(_LEGACY_FLOOR_PREFIX) else name: t
        for name, t in tensors.items()
    }


def _read_metadata(payload: bytes) -> dict[str, Any]:
    if len(payload) < 8:
        raise ValueError("file too short")
    header_len = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + header_len])
    if not isinstance(header, dict):
        raise ValueError("the safetensors header is not a JSON object")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise ValueError("the safetensors metadata is not a JSON object")
    raw = meta.get("layerparity")
    if not raw:
        return {}
    if not isinstance(raw, str):
        raise ValueError("the layerparity metadata is not a string")
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError("the layerparity metadata is not a JSON object")
    return value


def _check_entry(key: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> None:
    """A layer entry must hold its call spec, be the golden of that layer, and hold every
    tensor its call refers to (else replaying it would fail deep inside the test)."""
    if key == MODEL_LOGITS_KEY:
        _check_model_logits(key, tensors, metadata)
        return
    index = golden_layer(key)
    if index is None:
        return
    call = metadata.get("call")
    if not isinstance(call, dict):
        raise ValueError(f"{key}: the file holds no call spec (its 'call' metadata is missing)")
    layer = metadata.get("layer")
    if layer is not None and layer != index:
        raise ValueError(f"{key}: the file holds the golden of layer {layer!r}, not of {key}")
    missing = sorted(set(tensor_names(call)) - set(tensors))
    if missing:
        raise ValueError(f"{key}: its call refers to tensors the file does not hold ({', '.join(missing)})")
    try:
        Envelope.from_metadata(metadata.get("envelope"))
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


def _check_model_logits(key: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> None:
    """The whole model's golden must hold its compact logits for every position it fed."""
    from ..compare.logits import LOGSUMEXP, TOPK_IDS, TOPK_LOGITS, ModelEnvelope

    missing = sorted({TOPK_IDS, TOPK_LOGITS, LOGSUMEXP, "input_ids"} - set(tensors))
    if missing:
        raise ValueError(f"{key}: the whole model's golden lacks {', '.join(missing)}")
    fed = tensors["input_ids"].shape[-1] + (tensors["decode_ids"].shape[-1] if "decode_ids" in tensors else 0)
    if tensors["topk_ids"].shape[:-1] != tensors["logsumexp"].shape or tensors["logsumexp"].shape[-1] != fed:
        raise ValueError(
            f"{key}: the whole model's golden holds logits of {tuple(tensors['logsumexp'].shape)} "
            f"positions for {fed} tokens fed"
        )
    try:
        ModelEnvelope.from_metadata(metadata.get("envelope"))
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


#: Elements of a tensor summed at once by :func:`check_finite`: the sum converts them to float64
#: first, so a chunk holds 8 bytes an element (2 MB), whatever the tensor's size.
FINITE_CHUNK = 1 << 18


def all_finite_by_sum(tensor: torch.Tensor, chunk: int = FINITE_CHUNK) -> bool:
    """Whether every value of a 16- or 32-bit ``tensor`` is finite: chunked float64 sums, no
    mask of the tensor's size."""
    import torch

    flat = tensor.reshape(-1)
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, flat.numel(), chunk):
        total += torch.sum(flat[start : start + chunk], dtype=torch.float64)
    return bool(torch.isfinite(total))


def check_finite(key: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuse NaN anywhere and Inf in hidden states (masks may hold -inf legitimately)."""
    import torch

    for name, tensor in tensors.items():
        if not torch.is_floating_point(tensor):
            continue
        # The common case in one cheap pass: a float64 sum is finite exactly when every value
        # is (16- and 32-bit values cannot overflow it); in chunks, since the sum converts its
        # input to float64 first (logits of 2k tokens x 32k vocabulary: 0.5 GB at once; a
        # chunk of 2^22 elements held 32 MB beside a layer of a few, measured).
        if tensor.dtype != torch.float64 and all_finite_by_sum(tensor):
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


def _split_nonfinite(key: str, tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(the tensors check_finite accepts, {name: why} for those it refuses)."""
    kept: dict[str, torch.Tensor] = {}
    omitted: dict[str, str] = {}
    for name, tensor in tensors.items():
        try:
            check_finite(key, {name: tensor})
        except ValueError as exc:
            omitted[name] = str(exc)
        else:
            kept[name] = tensor
    return kept, omitted


def _is_hidden_state(name: str) -> bool:
    return name.startswith(("output", "args.0", FLOOR_KEY)) or name in {"embeddings", "logits"}
