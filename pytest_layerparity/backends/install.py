"""What each side needs installed, and the command that installs it."""

from __future__ import annotations

import importlib.util

from .base import BackendUnavailable

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
