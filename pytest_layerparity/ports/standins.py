"""Stand-ins for the closed-source Neuron packages, so that neuronx-distributed (NxD) and
neuronx-distributed-inference (NxDI) import on a machine without the Neuron SDK.

NxD's and NxDI's Python sources are open; at import time they reach into ``torch_neuronx``,
``neuronxcc``, ``nki``, ``nkilib`` and ``libneuronxla`` (the compiler, its kernel language and
kernels, the runtime), which are not. A decoder layer's forward in NxD's CPU mode calls none of
them. Each missing package is supplied by an import hook whose modules hand out placeholders:
a placeholder can be imported, named in an annotation, subclassed, and applied as a decorator
(``@nki.jit``), but calling one on a tensor raises ``NeuronOnlyError`` naming it, so a forward
that would need the Neuron compiler fails loudly instead of computing something else.

Five values are real. ``torch_neuronx.__version__`` is a 2.x version marked ``+standin``:
NxD's ``ModelBuilder``, whose checkpoint sharding (what NxDI does on load) runs on the CPU,
refuses a torch-neuronx older than 2. Four more because NxD computes with them while setting up
its groups: ``torch_neuronx.utils.get_platform_target()`` (``NEURON_PLATFORM_TARGET_OVERRIDE``, else
``trn1``, the default NxD assumes), the ``torch.classes.neuron`` namespace (named in an
annotation), ``xla_hlo_call`` for NxDI's layer-boundary markers (an HLO custom call
that returns its operands: the identity), and ``CollectivesConfig(groups).rank_src_tgt_pairs``
(the ring neighbours NxD stores for context-parallel attention).

Nothing is installed where the real package imports: on a Trainium machine these are never used.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any

#: The closed-source packages NxD and NxDI import.
CLOSED_SOURCE = ("torch_neuronx", "neuronxcc", "nki", "nkilib", "libneuronxla")
DEFAULT_PLATFORM = "trn1"


class NeuronOnlyError(RuntimeError):
    """A Neuron compiler or runtime function was called where only its stand-in exists."""


class Placeholder:
    """An attribute of a stood-in package."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr: str) -> Placeholder:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        if any(isinstance(v, torch.Tensor) for v in (*args, *kwargs.values())):
            raise NeuronOnlyError(
                f"{self._name} needs the Neuron SDK (it is a stand-in here: the closed-source Neuron packages are "
                "not installed); this configuration of the port calls a Neuron kernel on the CPU"
            )
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # applied as a decorator at import time: keep the function
        return Placeholder(f"{self._name}(...)")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)

    def __iter__(self):
        return iter(())

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self.__name__}.{attr}")


def platform_target(compiler_args: Any = None) -> str:
    """The Neuron platform NxD sets its groups up for: ``NEURON_PLATFORM_TARGET_OVERRIDE``
    (the variable the real function reads first), else trn1."""
    return os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", DEFAULT_PLATFORM)


class CollectivesConfig:
    """The ring neighbours of each rank in its context-parallel group: ``rank_src_tgt_pairs[r]``
    is ``[[previous rank, r]]``."""

    def __init__(self, replica_groups: list[list[int]], **_: Any) -> None:
        self.rank_src_tgt_pairs: dict[int, list[list[int]]] = {}
        for group in replica_groups:
            for i, rank in enumerate(group):
                self.rank_src_tgt_pairs[rank] = [[group[(i - 1) % len(group)], rank]]


#: HLO-building functions whose custom call returns its operands unchanged: NxDI's layer
#: boundary markers (``models/layer_boundary_marker.py``), which tell the compiler where a
#: module starts and ends. On the CPU they are the identity.
IDENTITY_HLO_CALLS = {
    ("neuronx_distributed_inference.models.layer_boundary_marker", "ModuleMarkerStart.forward_impl"),
    ("neuronx_distributed_inference.models.layer_boundary_marker", "ModuleMarkerEnd.forward_impl"),
}


def xla_hlo_call(fn: Any) -> Any:
    """torch-neuronx's ``xla_hlo_call`` (turns an HLO-building function into an XLA op):
    the identity for the layer-boundary markers, ``NeuronOnlyError`` for anything else."""
    name = getattr(fn, "__qualname__", repr(fn))
    identity = (getattr(fn, "__module__", None), name) in IDENTITY_HLO_CALLS

    def call(*args: Any) -> Any:
        if identity:
            return args[0] if len(args) == 1 else args
        raise NeuronOnlyError(f"{name} builds an HLO custom call, which needs the Neuron SDK (a stand-in here)")

    return call


_REAL_VALUES: dict[str, dict[str, Any]] = {
    "torch_neuronx": {"__version__": "2.9.0.0.0+standin"},  # torch-xla 2.9's, build 0: a stand-in
    "torch_neuronx.xla_impl.base": {"xla_hlo_call": xla_hlo_call},
    "torch_neuronx.utils": {"get_platform_target": platform_target},
    "torch_neuronx.utils.utils": {
        "get_platform_target": platform_target,
        "SUPPORTED_TYPES": {"trn1", "trn1n", "trn2"},
    },
    "neuronxcc.nki._pre_prod_kernels.collectives": {"CollectivesConfig": CollectivesConfig},
    "neuronxcc.nki._private_kernels.collectives": {"CollectivesConfig": CollectivesConfig},
}


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".", maxsplit=1)[0] not in self.roots:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        module.__doc__ = "stand-in for a closed-source Neuron module (pytest_layerparity.ports.standins)"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        for attr, value in _REAL_VALUES.get(module.__name__, {}).items():
            setattr(module, attr, value)


_FINDER: _StandInFinder | None = None


def install() -> list[str]:
    """Stand in for each closed-source Neuron package that is not installed (torch_xla is
    imported first: it loads the real ``libneuronxla`` plugin where one exists). Returns the
    packages stood in; idempotent."""
    global _FINDER
    if _FINDER is not None:
        return list(_FINDER.roots)
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        pass
    missing = tuple(
        root for root in CLOSED_SOURCE if root not in sys.modules and importlib.util.find_spec(root) is None
    )
    if not missing:
        return []
    _FINDER = _StandInFinder(missing)
    sys.meta_path.insert(0, _FINDER)
    if "torch_neuronx" in missing:
        _stand_in_torch_classes()
    return list(missing)


def _stand_in_torch_classes() -> None:
    """``torch.classes.neuron``: NxD names ``torch.classes.neuron.SPMDModel`` in an annotation
    (registered by torch-neuronx's C++ library)."""
    import torch

    class _Namespace:
        def __getattr__(self, attr: str) -> Placeholder:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return Placeholder(f"torch.classes.neuron.{attr}")

    torch.classes.neuron = _Namespace()
