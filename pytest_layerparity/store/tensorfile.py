"""Write a safetensors file straight from the tensors' memory, hashing as it goes.

safetensors' own writers copy every tensor into a ``bytes`` first (``save`` builds the
whole file in memory, ``save_file`` a copy of each tensor): writing a golden of 131 MB of
logits held 262 MB or more. This writes the same format (a little-endian u64 header length,
the JSON header padded with spaces to 8 bytes, then the tensors' bytes back to back) a block
at a time from each tensor's own storage; safetensors reads it like its own files (tests).
Tensors are laid out as safetensors lays them out (by dtype, widest first, then by name), so
the file is the one safetensors would write, byte for byte (tests).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: The dtypes safetensors stores, in the order of its ``Dtype`` (the file lays tensors out by
#: that order, highest first, then by name): its name, torch's, bytes per element. The one
#: table of them; the lookups below are views of it.
SAFETENSORS_DTYPES = (
    ("BOOL", "bool", 1),
    ("U8", "uint8", 1),
    ("I8", "int8", 1),
    ("F8_E5M2", "float8_e5m2", 1),
    ("F8_E4M3", "float8_e4m3fn", 1),
    ("I16", "int16", 2),
    ("U16", "uint16", 2),
    ("F16", "float16", 2),
    ("BF16", "bfloat16", 2),
    ("I32", "int32", 4),
    ("U32", "uint32", 4),
    ("F32", "float32", 4),
    ("F64", "float64", 8),
    ("I64", "int64", 8),
    ("U64", "uint64", 8),
)
#: torch's name -> safetensors' name, in safetensors' order.
DTYPE_NAMES = {torch_name: name for name, torch_name, _ in SAFETENSORS_DTYPES}
#: safetensors' name -> torch's name (little-endian, as the format stores them).
SAFETENSORS_TORCH_DTYPE = {name: torch_name for name, torch_name, _ in SAFETENSORS_DTYPES}
#: safetensors' name -> bytes per element.
SAFETENSORS_ITEMSIZE = {name: size for name, _, size in SAFETENSORS_DTYPES}
BLOCK_BYTES = 1 << 22


@cache
def _dtypes() -> dict[torch.dtype, tuple[int, str]]:
    """torch dtype -> (its rank in safetensors' order, safetensors' name)."""
    import torch

    return {getattr(torch, name): (rank, st) for rank, (name, st) in enumerate(DTYPE_NAMES.items())}


def write_all(fd: int, data: bytes | memoryview) -> None:
    """``os.write`` until every byte is out: a short write is retried, a full disk raises.
    Every byte the store writes goes through here."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous()  # no copy where it already is


def header_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> tuple[bytes, list[str]]:
    """The file's length prefix and padded JSON header, and the order the tensors' bytes follow in."""
    dtypes = _dtypes()
    for name, tensor in tensors.items():
        if tensor.dtype not in dtypes:
            raise TypeError(f"{name}: safetensors has no dtype for {tensor.dtype}")
    order = sorted(tensors, key=lambda name: (-dtypes[tensors[name].dtype][0], name))
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in order:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": dtypes[tensor.dtype][1],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, order


def _tensor_blocks(tensor: torch.Tensor) -> Iterator[memoryview]:
    """The tensor's bytes, as memoryviews of at most BLOCK_BYTES over its own storage."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return
    import torch

    view = memoryview(flat.view(torch.uint8).numpy())
    for start in range(0, len(view), BLOCK_BYTES):
        yield view[start : start + BLOCK_BYTES]


def write_tensors(
    fd: int, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[str, int]:
    """Write ``tensors`` as a safetensors file to the open file ``fd``; return the file's
    sha256 (hex) and length in bytes. No tensor is copied whole (a CPU, contiguous tensor
    not at all)."""
    tensors = {name: _cpu_contiguous(tensor) for name, tensor in tensors.items()}
    head, order = header_bytes(tensors, metadata)
    digest = hashlib.sha256(head)
    write_all(fd, head)
    length = len(head)
    for name in order:
        for block in _tensor_blocks(tensors[name]):
            digest.update(block)
            write_all(fd, block)
            length += len(block)
    return digest.hexdigest(), length


def save_tensors(
    path: os.PathLike[str] | str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    """``write_tensors`` into a new file at ``path`` (no fsync: for scratch files)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        write_tensors(fd, tensors, metadata)
    finally:
        os.close(fd)
