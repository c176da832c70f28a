from __future__ import annotations

import os
from typing import Any

from .base import Backend


class XlaBackend(Backend):
    """Any torch-xla device (CPU with PJRT_DEVICE=CPU, TPU, Neuron through its PJRT plugin)."""

    name = "xla"
    lazy = True

    def __init__(self) -> None:
        self._device = None

    def setup(self) -> None:
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        import torch_xla

        self._device = torch_xla.device()

    @property
    def device(self) -> Any:
        if self._device is None:
            self.setup()
        return self._device

    def sync(self) -> None:
        import torch_xla

        torch_xla.sync()

    def describe(self) -> str:
        import torch_xla

        return f"{self.device} (torch-xla {torch_xla.__version__}, PJRT_DEVICE={os.environ.get('PJRT_DEVICE')})"
