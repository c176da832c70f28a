"""The store's safetensors writer (store.tensorfile): it writes from the tensors' own memory,
and what it writes is what safetensors writes, byte for byte."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save

from pytest_layerparity.store import tensorfile

G = torch.Generator().manual_seed(0)
BASE = torch.randn(6, 8, generator=G)
CASES = {
    "one float32": {"x": torch.randn(3, 4, generator=G)},
    "every width": {
        "ids": torch.arange(7),
        "mask": torch.rand(5, generator=G) > 0.5,
        "h": torch.randn(2, 3, generator=G).to(torch.bfloat16),
        "f16": torch.randn(4, generator=G).half(),
        "scalar": torch.tensor(3.5),
        "f64": torch.randn(3, generator=G).double(),
        "f8": torch.randn(5, generator=G).to(torch.float8_e4m3fn),
        "u8": torch.arange(3, dtype=torch.uint8),
        "empty": torch.empty(0, 3),
    },
    "views of one storage": {"rows": BASE[2:], "cols": BASE[:, 1:], "same": BASE},
}


@pytest.mark.parametrize("metadata", [None, {"layerparity": '{"kind": "layer"}'}])
@pytest.mark.parametrize("case", list(CASES))
def test_written_file_is_what_safetensors_writes(tmp_path, case, metadata):
    tensors = CASES[case]
    path = tmp_path / "t.safetensors"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        sha256, length = tensorfile.write_tensors(fd, tensors, metadata)
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert data == save({k: v.contiguous().clone() for k, v in tensors.items()}, metadata=metadata)
    assert (sha256, length) == (hashlib.sha256(data).hexdigest(), len(data))
    loaded = load_file(path)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(
            loaded[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
        )


def test_large_tensors_go_out_in_blocks_from_their_own_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(tensorfile, "BLOCK_BYTES", 64)
    big = torch.randn(40, 9, generator=G)  # 1440 bytes: 23 blocks
    seen = []
    write_all = tensorfile.write_all

    def recording(fd, data):
        seen.append(data)
        write_all(fd, data)

    monkeypatch.setattr(tensorfile, "write_all", recording)
    tensorfile.save_tensors(tmp_path / "t.safetensors", {"big": big})
    blocks = seen[1:]  # after the header
    assert len(blocks) == 23 and all(len(b) <= 64 for b in blocks)
    addresses = [np.frombuffer(b, dtype=np.uint8).__array_interface__["data"][0] for b in blocks]
    assert addresses == [big.data_ptr() + 64 * i for i in range(23)]  # the tensor's own memory, no copy
    assert torch.equal(load_file(tmp_path / "t.safetensors")["big"], big)


def test_a_dtype_safetensors_cannot_store_is_refused_by_name(tmp_path):
    with pytest.raises(TypeError, match=r"c: safetensors has no dtype for torch\.complex64"):
        tensorfile.save_tensors(tmp_path / "t.safetensors", {"c": torch.zeros(2, dtype=torch.complex64)})
