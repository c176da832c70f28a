"""A recording stand-in for the parts of the AWS Neuron SDK the plugin calls.

The Neuron SDK (torch-neuronx, neuronx-distributed) cannot be installed here: AWS publishes it
on its own package index, and the PyPI packages of the same names are empty placeholders. So
the tests put this stand-in where the real modules would be, and check the calls the plugin
makes against it. Everything else in those tests is real: torch.distributed's process group
on the torch-xla CPU device, the environment, torchrun, xdist.

``RecordingParallelState`` mirrors the part of ``neuronx_distributed.parallel_layers.parallel_state``
that the plugin uses, with the real signatures and checks (read from neuronx-distributed's
source): ``initialize_model_parallel`` asserts an initialised torch.distributed, caps each
degree at the world size and refuses a world size that is not a multiple of it; a second
``initialize_model_parallel`` rebuilds the groups, as the real one does (NxDI's test helpers and
``ModelBuilder`` re-initialise in one process); the getters NxDI's layers and the plugin's
examples call answer as the real ones do for the default group layout (tensor-parallel rank =
global rank modulo the degree, data parallel = world / (tp x pp x cp), expert parallel 1).
Whether the plugin initialises once is checked by counting the recorded calls. Each call is
appended, as one JSON line, to the file named by ``$STANDIN_RECORD`` (when set) and to
``CALLS``. Where the real ``parallel_state`` can run (NxD's CPU mode, a gloo group), the tests
use it instead: ``tests/nxdi``.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

PARALLEL_STATE_SOURCE = '''
"""RecordingParallelState: a stand-in for neuronx_distributed.parallel_layers.parallel_state
(the Neuron SDK cannot be installed here). See tests/standin_neuron_sdk.py."""
import json
import os

import torch
import torch.distributed

CALLS = []
_TP_SIZE = None
_DP_SIZE = None


def _record(name, **fields):
    dist = torch.distributed
    entry = {"call": name, "pid": os.getpid(), **fields}
    if dist.is_initialized():
        entry.update(pg_backend=str(dist.get_backend()), pg_rank=dist.get_rank(),
                     pg_world_size=dist.get_world_size())
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NEURON_RT_VISIBLE_CORES",
             "NEURON_COMPILE_CACHE_URL", "PYTEST_XDIST_WORKER")
    entry["env"] = {k: os.environ.get(k) for k in names}
    CALLS.append(entry)
    path = os.environ.get("STANDIN_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\\n")


def initialize_model_parallel(
    tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1,
    context_parallel_size=1,
    expert_model_parallel_size=1,
    skip_collective_init=False,
    lnc_size=1,
    mesh_only=False,
):
    global _TP_SIZE, _DP_SIZE
    assert torch.distributed.is_initialized()
    rebuilt = _TP_SIZE is not None
    world_size = torch.distributed.get_world_size()
    tp = min(tensor_model_parallel_size, world_size)
    pp = min(pipeline_model_parallel_size, world_size)
    cp = min(context_parallel_size, world_size)
    if world_size % (tp * pp * cp) != 0:
        raise RuntimeError(f"invalid implied data parallel degree: `world_size` ({world_size}) is not divisible by ...")
    _TP_SIZE = tp
    _DP_SIZE = world_size // (tp * pp * cp)
    _record(
        "initialize_model_parallel", tensor_model_parallel_size=tensor_model_parallel_size, effective_tp=tp,
        rebuilt=rebuilt,
    )


def model_parallel_is_initialized():
    return _TP_SIZE is not None


def get_tensor_model_parallel_size():
    assert _TP_SIZE is not None, "intra_layer_model parallel group is not initialized"
    return _TP_SIZE


def get_tensor_model_parallel_rank():
    assert _TP_SIZE is not None, "intra_layer_model parallel group is not initialized"
    return torch.distributed.get_rank() % _TP_SIZE


def get_data_parallel_size():
    assert _DP_SIZE is not None, "data parallel group is not initialized"
    return _DP_SIZE


def get_expert_model_parallel_size():
    assert _TP_SIZE is not None, "intra_layer_model parallel group is not initialized"
    return 1


def destroy_model_parallel():
    global _TP_SIZE, _DP_SIZE
    _TP_SIZE = _DP_SIZE = None
    _record("destroy_model_parallel")
'''

PACKAGES = {
    "torch_neuronx/__init__.py": '"""Stand-in for torch-neuronx (the Neuron SDK cannot be installed here)."""\n',
    "neuronx_distributed/__init__.py": (
        '"""Stand-in for neuronx-distributed (the Neuron SDK cannot be installed here)."""\n'
    ),
    "neuronx_distributed/parallel_layers/__init__.py": "",
    "neuronx_distributed/parallel_layers/parallel_state.py": PARALLEL_STATE_SOURCE,
}


def write_standin_sdk(folder: Path) -> Path:
    """Write the stand-in packages into ``folder`` (put it on PYTHONPATH); returns ``folder``."""
    for relative, text in PACKAGES.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder


def recording_parallel_state() -> types.ModuleType:
    """A fresh RecordingParallelState module object (for sys.modules in-process)."""
    module = types.ModuleType("neuronx_distributed.parallel_layers.parallel_state")
    module.__doc__ = "RecordingParallelState stand-in"
    exec(compile(PARALLEL_STATE_SOURCE, "<RecordingParallelState>", "exec"), module.__dict__)
    return module


def install_in_sys_modules(monkeypatch) -> types.ModuleType:
    """Put RecordingParallelState (and empty parent packages) into sys.modules for this test."""
    import importlib.machinery

    state = recording_parallel_state()
    packages = {}
    for name in ("torch_neuronx", "neuronx_distributed", "neuronx_distributed.parallel_layers"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
        module.__path__ = []
        packages[name] = module
        monkeypatch.setitem(sys.modules, name, module)
    state.__spec__ = importlib.machinery.ModuleSpec(state.__name__, loader=None)
    monkeypatch.setattr(packages["neuronx_distributed.parallel_layers"], "parallel_state", state, raising=False)
    monkeypatch.setitem(sys.modules, state.__name__, state)
    return state
