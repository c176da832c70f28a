from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class BackendUnavailable(Exception):
    """The backend cannot run here; the message names what to install or change."""


class Backend:
    """A device to run layers on. Subclasses set ``name`` and override what differs."""

    name = "cpu"
    #: True where graphs compile lazily, so layer modules should use the portable
    #: (eager) implementations of attention and experts.
    lazy = False
    #: Whether the device's float16 matmuls may keep their partial sums in float16 (a float16
    #: golden's envelope then holds the target to its runs that may; else to those that sum
    #: in float32: ``compare.envelope.Envelope.for_target``). torch's CPU kernels sum in float32.
    sixteen_bit_sums = False

    @classmethod
    def free_memory(cls) -> int | None:
        """Bytes free on the device, known before it is set up (None where they are not)."""
        return None

    def setup(self) -> None:
        """Bring the runtime up (once per session)."""

    def teardown(self) -> None:
        """Release what setup() took."""

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    def sync(self) -> None:
        """Wait until every queued operation has run."""

    def running(self) -> contextlib.AbstractContextManager[Any]:
        """Entered while the port runs on this device (a layer, or the whole model): what its
        ops need here that they do not elsewhere. Nothing by default."""
        return contextlib.nullcontext()

    def describe(self) -> str:
        return self.name

    def cache_summary(self) -> str | None:
        """One line on the compile cache's use in this process, or None."""
        return None
