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


#: The oldest transformers 5 release the plugin runs with (its checkpoint loader's API);
#: pyproject.toml's extras ask for it, and CI runs a job with it.
OLDEST_TRANSFORMERS_5 = (5, 16)


def check_installed(what: str) -> None:
    """Raise BackendUnavailable, with the install command, when ``what`` cannot be imported
    (or, for the reference side, is a transformers 5 release older than the plugin supports)."""
    missing = missing_modules(what)
    if missing:
        raise BackendUnavailable(f"{', '.join(missing)} not installed; {INSTALL_HINTS[what]}")
    if what == "reference":
        check_transformers_version(_installed_version("transformers"))


def _installed_version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def check_transformers_version(installed: str) -> None:
    """Refuse a transformers 5 release older than :data:`OLDEST_TRANSFORMERS_5` (4.57, which
    NxDI pins, runs the NxDI environment's side and is let through)."""
    parts = tuple(int(p) for p in installed.split(".")[:2] if p.isdigit())
    if len(parts) == 2 and parts[0] == 5 and parts < OLDEST_TRANSFORMERS_5:
        oldest = ".".join(map(str, OLDEST_TRANSFORMERS_5))
        raise BackendUnavailable(
            f"transformers {installed} is older than {oldest}, the oldest 5.x release the plugin supports "
            f"(its checkpoint loader changed); pip install -U 'transformers>={oldest}'"
        )
