"""The chunks every comparison metric is computed from (:mod:`.metrics`): flat views of the
inputs and float64 buffers on golden's device, filled one chunk at a time, so the extra memory
is a handful of float64 chunk buffers whatever the size of the inputs (12 MiB with the CPU
default chunk; on the CPU that block is kept per thread for the next call).

Devices: the work runs on golden's device when that is the CPU or CUDA (a target or
reference elsewhere is brought over chunk by chunk); tensors on any other device (XLA,
MPS, ...) are copied to the CPU first, whole."""

from __future__ import annotations

import threading
from typing import Any

import torch

# Default chunk lengths (elements). CPU: five float64 buffers of 256 Ki elements (10 MiB)
# stay in the L3 cache while keeping the per-op overhead (~20 ops a chunk) small; measured
# best on 2 cores (128 Ki: ~5% slower, 512 Ki: ~10% slower, 64 Ki: ~30% slower).
_CPU_CHUNK = 1 << 18
# GPU: five float64 buffers of 1 Mi elements is 40 MiB, few kernel launches.
_GPU_CHUNK = 1 << 20

#: Devices whose tensors' float64 statistics are computed where they are (here chunk by
#: chunk, and ``floor.statistics_device``'s); any other device's go to the CPU (an XLA device
#: would compile a graph per chunk; MPS has no float64).
STATISTICS_DEVICES = ("cpu", "cuda")


def as_tensor(x: Any, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    if x.is_complex():
        raise TypeError(f"{name}: complex tensors are not supported (dtype {x.dtype})")
    return x.detach()


def check_shapes(golden: torch.Tensor, other: torch.Tensor, name: str) -> None:
    if tuple(golden.shape) != tuple(other.shape):
        raise ValueError(
            f"shape mismatch: golden has shape {tuple(golden.shape)}, {name} has shape {tuple(other.shape)}"
        )


# CPU chunk buffers are kept (one block per thread, up to _CACHED_BLOCK_MAX float64) and
# reused across calls: writing into freshly mapped memory page-faults, and on a 1M-element
# comparison that first touch of ~12 MiB cost more (~3 ms) than the arithmetic (~2 ms).
# CUDA needs no such cache: torch's caching allocator already reuses device memory.
_CACHED_BLOCK_MAX = 8 * _CPU_CHUNK
_local = threading.local()


def _take_block(device: torch.device, numel: int) -> torch.Tensor:
    if device.type == "cpu" and numel <= _CACHED_BLOCK_MAX:
        block = getattr(_local, "block", None)
        _local.block = None  # in use: a nested call would allocate its own
        if block is not None and block.numel() >= numel:
            return block
        return torch.empty(numel, dtype=torch.float64)
    return torch.empty(numel, dtype=torch.float64, device=device)


def _give_back_block(device: torch.device, block: torch.Tensor | None) -> None:
    if block is None or device.type != "cpu" or block.numel() > _CACHED_BLOCK_MAX:
        return
    current = getattr(_local, "block", None)
    if current is None or current.numel() < block.numel():
        _local.block = block


class Chunks:
    """Flat views of the inputs and float64 chunk buffers on golden's device.

    golden and target of a chunk are widened into the two rows of one (2, chunk) buffer,
    so that both sums are one reduction; a floor goes to a buffer of its own.
    """

    def __init__(self, tensors: list[torch.Tensor], chunk_elements: int | None, nscratch: int):
        # Compute where golden lives when that is the CPU or a CUDA device. Other devices
        # (XLA and other lazy or float64-less backends) are brought to the CPU whole, once:
        # slicing them chunk by chunk would run (and on XLA compile) one graph per chunk.
        tensors = [t if t.device.type in STATISTICS_DEVICES else t.cpu() for t in tensors]
        self.device = tensors[0].device
        self.flat = [t.reshape(-1) for t in tensors]
        self.numel = self.flat[0].numel()
        if chunk_elements is None:
            chunk_elements = _CPU_CHUNK if self.device.type == "cpu" else _GPU_CHUNK
        chunk_elements = int(chunk_elements)
        if chunk_elements <= 0:
            raise ValueError(f"chunk_elements must be positive, got {chunk_elements}")
        self.chunk = max(1, min(chunk_elements, self.numel))
        self.nchunks = -(-self.numel // self.chunk) if self.numel else 0
        nrows = len(self.flat) + nscratch
        self._block = _take_block(self.device, nrows * self.chunk)
        rows = self._block[: nrows * self.chunk].view(nrows, self.chunk)
        self.pair = rows[:2]
        self.extra = list(rows[2 : len(self.flat)])
        self.scratch = list(rows[len(self.flat) :])

    def __enter__(self) -> Chunks:
        return self

    def __exit__(self, *exc) -> None:
        _give_back_block(self.device, self._block)
        self._block = None

    def bounds(self, i: int) -> tuple[int, int]:
        s = i * self.chunk
        return s, min(self.numel, s + self.chunk)

    def load(self, i: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Chunk ``i`` in float64: the (2, m) golden/target pair and the other inputs."""
        s, e = self.bounds(i)
        pair = self.pair[:, : e - s]
        pair[0].copy_(self.flat[0][s:e])
        pair[1].copy_(self.flat[1][s:e])
        rest = []
        for f, buf in zip(self.flat[2:], self.extra, strict=False):
            v = buf[: e - s]
            v.copy_(f[s:e])
            rest.append(v)
        return pair, rest

    def scratch_for(self, m: int) -> list[torch.Tensor]:
        return [b[:m] for b in self.scratch]


def to_host(rows: list[list[torch.Tensor]]) -> list[list[float]]:
    if not rows:
        return []
    return torch.stack([torch.stack(r) for r in rows]).cpu().tolist()
