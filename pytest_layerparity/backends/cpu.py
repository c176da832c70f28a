from __future__ import annotations

from .base import Backend


class CpuBackend(Backend):
    name = "cpu"

    def describe(self) -> str:
        import torch

        return f"cpu (torch {torch.__version__}, {torch.get_num_threads()} threads)"
