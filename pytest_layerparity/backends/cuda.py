from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from .base import Backend, BackendUnavailable


class CudaBackend(Backend):
    """A CUDA device. Its float16 matmuls sum in float32 (cuBLAS's compute type for them in
    torch; a split-K's few partial sums may be added in float16, which the runs' own rounding
    covers: measured in bench/README.md)."""

    name = "cuda"

    def setup(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise BackendUnavailable("--target cuda: no CUDA device is visible (torch.cuda.is_available() is False)")

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device("cuda", torch.cuda.current_device())

    def sync(self) -> None:
        import torch

        torch.cuda.synchronize()

    def describe(self) -> str:
        import torch

        index = torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)}, torch {torch.__version__})"
