"""What every backend that runs on a torch-xla device shares (``--xla`` and ``--neuron``):
the device, set up on first use, the sync that runs what was queued, and the index guard
torch-xla needs while a port runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Backend

if TYPE_CHECKING:
    import torch

    from .xla_ops import XlaIndexing


class TorchXlaBackend(Backend):
    """A backend on a torch-xla device; a subclass's ``setup()`` sets ``_device``."""

    lazy = True
    _device = None

    @property
    def device(self) -> torch.device:
        if self._device is None:
            self.setup()
        return self._device

    def sync(self) -> None:
        import torch_xla

        torch_xla.sync()

    def running(self) -> XlaIndexing:
        """torch-xla aborts on an index op whose index comes straight from a sort or top-k
        (backends/xla_ops.py): each such index is taken as a view of itself, and raises on a
        slice reaching before a dimension's start: such a bound is clamped, as eager does."""
        from .xla_ops import XlaIndexing

        return XlaIndexing()
