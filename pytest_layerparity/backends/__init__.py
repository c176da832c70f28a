"""Target and reference devices. Each backend imports its runtime lazily, so that
``pytest --help`` and runs that don't use a backend never import it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Backend, BackendUnavailable
from .install import INSTALL_HINTS, check_installed, missing_modules

if TYPE_CHECKING:
    from ..options import Settings

TARGETS = ("cpu", "cuda", "xla", "neuron")


def backend_class(name: str) -> type[Backend]:
    """The backend class of a target name (its module imports no runtime)."""
    if name == "cpu":
        from .cpu import CpuBackend

        return CpuBackend
    if name == "cuda":
        from .cuda import CudaBackend

        return CudaBackend
    if name == "xla":
        from .xla import XlaBackend

        return XlaBackend
    if name == "neuron":
        from .neuron import NeuronBackend

        return NeuronBackend
    raise BackendUnavailable(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}")


def create_backend(name: str, options: Settings | None = None) -> Backend:
    """A backend by target name. ``options`` carries backend settings (e.g. tp_degree)."""
    cls = backend_class(name)
    if name in ("xla", "neuron"):
        check_installed(name)
    if name == "xla":
        return cls(compile_cache=getattr(options, "compile_cache", None))
    if name == "neuron":
        return cls(
            tp_degree=getattr(options, "tp_degree", 1),
            compile_cache=getattr(options, "compile_cache", None),
            logical_nc_config=getattr(options, "logical_nc_config", None),
        )
    return cls()


__all__ = [
    "INSTALL_HINTS",
    "TARGETS",
    "Backend",
    "BackendUnavailable",
    "backend_class",
    "check_installed",
    "create_backend",
    "missing_modules",
]
