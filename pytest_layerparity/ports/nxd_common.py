"""What every module of the NxDI port shares: its error, and NxD's and NxDI's own warnings
kept out of a project's ``filterwarnings = error``."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class PortError(Exception):
    """The NxDI port cannot be built as asked; the message names the fix."""


@contextmanager
def nxd_warnings_quiet() -> Iterator[None]:
    """NxD and NxDI's own deprecation notices (about their use of torch and of each other)
    are theirs to fix, not the port's: kept from a project's ``filterwarnings = error``."""
    with warnings.catch_warnings():
        for category in (DeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category, module=r"neuronx_distributed")
        warnings.filterwarnings("ignore", message="Removing redundant keys from checkpoint")
        yield


class PortParts(Protocol):
    """What a runtime reads of the port whose layers it runs (:class:`.nxdi.NxdiPort`)."""

    source: Callable[[], Any]  # the session's model folder

    @property
    def app(self) -> type: ...

    def inference_config(self, dtype: torch.dtype, batch_size: int, seq_len: int) -> Any: ...

    def neuron_config(self, **fields: Any) -> Any: ...

    def layer_state(self, index: int, config: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]: ...
