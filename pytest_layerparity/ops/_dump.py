"""Saving and loading one op's inputs/outputs without pickle.

File format (``pytest_layerparity.ops.dump/1``)
-----------------------------------------------
A dump is ONE ``.safetensors`` file.  Its tensors are the CPU copies of every
tensor in the saved values, stored under keys ``t0``, ``t1``, ... (a tensor
that appears twice, e.g. ``mul(x, x)``, is stored once and referenced twice).
Complex tensors are stored as ``torch.view_as_real`` and flagged.  The
safetensors header metadata (string -> string) holds:

``format``
    ``"pytest_layerparity.ops.dump/1"``.
``info``
    JSON object: ``op`` (schema name, ``aten::addmm.default``), ``op_name``
    (``torch.ops.aten.addmm``), ``kind`` (``inputs``/``outputs``), ``tool``,
    ``device`` (where the op ran, e.g. ``xla:0``), ``module_path``, ``phase``,
    ``step``, ``atol``/``rtol`` where relevant, ``torch_version``.
``structure``
    JSON object mapping each saved name (``args``, ``kwargs`` for inputs;
    ``out`` and ``cpu_out`` for outputs) to an encoded value:

    * ``{"t": "tensor", "key": "t0", "dtype": "torch.float16",
      "device": "xla:0", "shape": [...], "stride": [...], "complex": false,
      "requires_grad": false}``
    * ``{"t": "none"}``, ``{"t": "bool"|"int"|"str", "v": ...}``,
      ``{"t": "float", "v": 1.5}`` (``"nan"``, ``"inf"``, ``"-inf"`` as strings),
      ``{"t": "complex", "re": .., "im": ..}``
    * ``{"t": "list"|"tuple", "items": [...]}``, ``{"t": "dict", "items": [[key, value], ...]}``
    * ``{"t": "dtype", "v": "float16"}``, ``{"t": "device", "v": "xla:0"}``,
      ``{"t": "layout", "v": "strided"}``, ``{"t": "memory_format", "v": "contiguous_format"}``
    * ``{"t": "unsupported", "repr": "..."}`` for anything else (loading such a
      value raises :class:`DumpFormatError`).

Loading only parses JSON and the safetensors container, so a dump received
from elsewhere cannot run code.  Anything that is not such a file (a pickle
with a ``__reduce__`` payload renamed to the dump's name, say) is refused
with :class:`DumpFormatError`; pickles are never opened.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

__all__ = ["DUMP_FORMAT", "DumpFormatError", "dump_paths", "load_op_dump", "save_op_dump"]

DUMP_FORMAT = "pytest_layerparity.ops.dump/1"
DUMP_EXT = ".safetensors"


class DumpFormatError(ValueError):
    """The file is not a ``pytest_layerparity.ops`` safetensors dump."""


def dump_paths(output_dir: str, op_name: str) -> tuple[str, str]:
    """``<output_dir>/<op_name>_inputs.safetensors`` and ``..._outputs.safetensors``."""
    return (
        os.path.join(output_dir, f"{op_name}_inputs{DUMP_EXT}"),
        os.path.join(output_dir, f"{op_name}_outputs{DUMP_EXT}"),
    )


def _enc_float(v: float) -> Any:
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def _dec_float(v: Any) -> float:
    return float(v) if isinstance(v, str) else v


class _Encoder:
    def __init__(self, devices: dict[int, str] | None = None):
        self.tensors: dict[str, torch.Tensor] = {}
        self._seen: dict[int, str] = {}
        self._devices = devices or {}

    def enc(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return self._tensor(x)
        if x is None:
            return {"t": "none"}
        if isinstance(x, bool):
            return {"t": "bool", "v": x}
        if isinstance(x, (int, torch.SymInt)):
            return {"t": "int", "v": int(x)}
        if isinstance(x, (float, torch.SymFloat)):
            return {"t": "float", "v": _enc_float(float(x))}
        if isinstance(x, complex):
            return {"t": "complex", "re": _enc_float(x.real), "im": _enc_float(x.imag)}
        if isinstance(x, str):
            return {"t": "str", "v": x}
        if isinstance(x, torch.dtype):
            return {"t": "dtype", "v": str(x).replace("torch.", "")}
        if isinstance(x, torch.device):
            return {"t": "device", "v": str(x)}
        if isinstance(x, torch.layout):
            return {"t": "layout", "v": str(x).replace("torch.", "")}
        if isinstance(x, torch.memory_format):
            return {"t": "memory_format", "v": str(x).replace("torch.", "")}
        if isinstance(x, (list, tuple)):
            return {"t": "list" if isinstance(x, list) else "tuple", "items": [self.enc(y) for y in x]}
        if isinstance(x, dict):
            return {"t": "dict", "items": [[str(k), self.enc(v)] for k, v in x.items()]}
        return {"t": "unsupported", "repr": repr(x)[:200], "type": type(x).__name__}

    def _tensor(self, t: torch.Tensor) -> dict:
        key = self._seen.get(id(t))
        if key is None:
            key = f"t{len(self.tensors)}"
            self._seen[id(t)] = key
            data = t.detach().to("cpu")
            if data.is_complex():
                data = torch.view_as_real(data.resolve_conj())
            self.tensors[key] = data.contiguous().clone()
        return {
            "t": "tensor",
            "key": key,
            "dtype": str(t.dtype),
            "device": self._devices.get(id(t), str(t.device)),
            "shape": list(t.shape),
            "stride": list(t.stride()) if t.layout == torch.strided else None,
            "complex": t.is_complex(),
            "requires_grad": bool(t.requires_grad),
        }


def save_op_dump(path: str, values: dict[str, Any], info: dict[str, Any], devices: dict[int, str] | None = None) -> str:
    """Write ``values`` (name -> nested args) to ``path`` (see module doc).

    ``devices`` maps ``id(tensor)`` to the device the tensor originally lived
    on, for tensors passed as CPU copies."""
    from safetensors.torch import save_file

    enc = _Encoder(devices)
    structure = {name: enc.enc(v) for name, v in values.items()}
    meta = {
        "format": DUMP_FORMAT,
        "info": json.dumps({**info, "torch_version": torch.__version__}),
        "structure": json.dumps(structure),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(enc.tensors, path, metadata=meta)
    return path


def _resolve_path(path: str) -> str:
    if os.path.exists(path):
        return path
    root, _ext = os.path.splitext(path)
    for cand in (path + DUMP_EXT, root + DUMP_EXT):
        if os.path.exists(cand):
            return cand
    raise FileNotFoundError(path)


def load_op_dump(path: str, with_devices: bool = False):
    """Read a dump written by :func:`save_op_dump`: (values, info), or
    (values, info, devices) with ``with_devices=True``, where ``devices`` maps
    ``id(tensor)`` of each loaded tensor to its original device string.

    Accepts the file path, or the path without ``.safetensors`` (or with the
    ``.pkl`` suffix that torch_musa's docs use, when a ``.safetensors`` file
    of the same stem exists and no file of the given name does).
    Tensors come back on the CPU; their original devices are in the values'
    encoding and in ``info['device']``.
    """
    from safetensors import safe_open

    real = _resolve_path(path)
    try:
        with safe_open(real, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  safe_open is not iterable
    except Exception as e:
        raise DumpFormatError(
            f"{real} is not a pytest_layerparity.ops dump (a safetensors file): {e}. "
            "Refusing to load it; pickle files are never loaded."
        ) from None
    if meta.get("format") != DUMP_FORMAT:
        raise DumpFormatError(
            f"{real} is a safetensors file but not a {DUMP_FORMAT} dump (format={meta.get('format')!r})"
        )
    try:
        info = json.loads(meta["info"])
        structure = json.loads(meta["structure"])
    except (KeyError, ValueError) as e:
        raise DumpFormatError(f"{real}: bad dump metadata: {e}") from None

    devices: dict[int, str] = {}

    def dec(node: Any) -> Any:
        if not isinstance(node, dict) or "t" not in node:
            raise DumpFormatError(f"{real}: bad value node {node!r}")
        t = node["t"]
        if t == "tensor":
            if node.get("key") not in tensors:
                raise DumpFormatError(f"{real}: tensor {node.get('key')!r} missing")
            data = tensors[node["key"]]
            if node.get("complex"):
                data = torch.view_as_complex(data.contiguous())
            devices[id(data)] = str(node.get("device", "cpu"))
            return data
        if t == "none":
            return None
        if t in ("bool", "int", "str"):
            return node["v"]
        if t == "float":
            return _dec_float(node["v"])
        if t == "complex":
            return complex(_dec_float(node["re"]), _dec_float(node["im"]))
        if t == "dtype":
            dt = getattr(torch, node["v"], None)
            if not isinstance(dt, torch.dtype):
                raise DumpFormatError(f"{real}: unknown dtype {node['v']!r}")
            return dt
        if t == "device":
            return torch.device(node["v"])
        if t == "layout":
            return getattr(torch, node["v"])
        if t == "memory_format":
            return getattr(torch, node["v"])
        if t in ("list", "tuple"):
            items = [dec(y) for y in node["items"]]
            return items if t == "list" else tuple(items)
        if t == "dict":
            return {k: dec(v) for k, v in node["items"]}
        if t == "unsupported":
            raise DumpFormatError(
                f"{real}: a value of type {node.get('type')} ({node.get('repr')}) "
                "could not be saved, the op cannot be replayed"
            )
        raise DumpFormatError(f"{real}: unknown value kind {t!r}")

    values = {name: dec(node) for name, node in structure.items()}
    if with_devices:
        return values, info, devices
    return values, info
