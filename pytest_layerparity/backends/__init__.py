"""Target and reference devices. Each backend imports its runtime lazily, so that
``pytest --help`` and runs that don't use a backend never import it."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from .base import Backend, BackendUnavailable

if TYPE_CHECKING:
    from ..options import Settings

TARGETS = ("cpu", "cuda", "xla", "neuron")

INSTALL_HINTS = {
    "xla": "pip install 'pytest-layerparity[xla]'   (torch-xla==2.9.* with torch==2.9.*)",
    "neuron": (
        "install the AWS Neuron SDK from AWS's repository, not from PyPI (the PyPI packages are "
        "empty placeholders): pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "
        "torch-neuronx neuronx-cc neuronx-distributed neuronx-distributed-inference"
    ),
    "reference": "pip install 'pytest-layerparity[reference]'   (transformers and accelerate)",
}

_REQUIRED_MODULES = {
    "xla": ("torch_xla",),
    "neuron": ("torch_neuronx", "neuronx_distributed", "torch_xla"),
    "reference": ("transformers", "accelerate"),
}


def missing_modules(what: str) -> list[str]:
    """The modules that ``what`` (a target or 'reference') needs and that are not installed."""
    return [name for name in _REQUIRED_MODULES.get(what, ()) if importlib.util.find_spec(name) is None]


def check_installed(what: str) -> None:
    """Raise BackendUnavailable, with the install command, when ``what`` cannot be imported."""
    missing = missing_modules(what)
    if missing:
        raise BackendUnavailable(f"{', '.join(missing)} not installed; {INSTALL_HINTS[what]}")


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
        return cls(tp_degree=getattr(options, "tp_degree", 1), compile_cache=getattr(options, "compile_cache", None))
    return cls()


__all__ = [
    "TARGETS",
    "Backend",
    "BackendUnavailable",
    "backend_class",
    "check_installed",
    "create_backend",
    "missing_modules",
]
