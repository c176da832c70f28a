"""A recording stand-in for the parts of the AWS Neuron SDK the plugin calls.

The Neuron SDK (torch-neuronx, neuronx-distributed) cannot be installed here: AWS publishes it
on its own package index, and the PyPI packages of the same names are empty placeholders. So
the tests put this stand-in where the real modules would be, and check the calls the plugin
makes against it. Everything else in those tests is real: torch.distributed's process group
on the torch-xla CPU device, the environment, torchrun, xdist.

``RecordingParallelState`` mirrors the part of ``neuronx_distributed.parallel_layers.parallel_state``
that the plugin uses, with the real signatures (``tests/nxdi/test_signatures.py`` holds them
against neuronx-distributed's source) and checks: ``initialize_model_parallel`` asserts an
initialised torch.distributed, caps each degree at the world size and refuses a world size that
is not a multiple of it; unless ``skip_collective_init`` (or NxD's CPU mode, or ``mesh_only``)
it initialises the collectives as the real one does, with one all-reduce over the world on the
XLA device (real here: the "xla" process group on the torch-xla CPU device); ``lnc_size``, with
the platform (``NEURON_PLATFORM_TARGET_OVERRIDE``, else trn1, as the plugin's stand-in
``get_platform_target`` answers), picks how the tensor-parallel groups are laid over the ranks,
by the real one's table (``get_logic_chosen``: on trn2, LNC 1 at tp 64 and LNC 2 at tp 32 in a
world of 64 or more take the outer and inner rows of a node's cores); ``mesh_only`` returns the
groups and sets nothing up. A second ``initialize_model_parallel`` rebuilds the groups, as the
real one does (NxDI's test helpers and ``ModelBuilder`` re-initialise in one process); the
getters NxDI's layers and the plugin's examples call answer as the real ones do (tensor-parallel
rank: the rank's place in its group, data parallel = world / (tp x pp x cp), expert parallel 1).
Whether the plugin initialises once is checked by counting the recorded calls. Each call is
appended, as one JSON line, to the file named by ``$STANDIN_RECORD`` (when set) and to
``CALLS``. Where the real ``parallel_state`` can run (NxD's CPU mode, a gloo group, or
ModelBuilder's mocked world), ``tests/nxdi/test_standin_semantics.py`` runs both and compares.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

PARALLEL_STATE_SOURCE = '''
"""RecordingParallelState: a stand-in for neuronx_distributed.parallel_layers.parallel_state
(the Neuron SDK cannot be installed here). See tests/e2e/standin_neuron_sdk.py."""
import json
import os
import types

import torch
import torch.distributed

CALLS = []
_TP_SIZE = None
_DP_SIZE = None
_TP_GROUPS = None
_REPLICA_LOGIC = "LOGIC1"
#: neuronx_distributed.utils.utils.hardware: the platform targets NxD knows
_HARDWARE = {"trn1": "TRN1", "trn1n": "TRN1", "inf2": "TRN1", "trn2": "TRN2", "trn3": "TRN3"}


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


def _hardware():
    # torch_neuronx.utils.get_platform_target(): the override first; trn1 where unset, as here
    return _HARDWARE.get(os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1"), "CUSTOM")


def _replica_logic(lnc_size, hardware, tp, world_size):
    # get_logic_chosen: the rows of a trn2 node's cores, where LNC 1 at tp 64 or LNC 2 at tp 32 span them
    logic = {("TRN2", 1, 64): "LOGIC2", ("TRN2", 2, 32): "LOGIC2"}.get((hardware, lnc_size, tp), "LOGIC1")
    if hardware == "TRN2" and lnc_size == 2 and world_size < 64:
        logic = "LOGIC1"
    return logic


def _tp_groups(logic, hardware, tp, world_size):
    ranks = list(range(world_size))
    if logic == "LOGIC2":  # a node's cores in 4 rows: the outer two rows one group, the inner two another
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 64))
        row = per_node // 4
        groups = []
        for base in range(0, world_size, per_node):
            rows = [ranks[base + r * row:base + (r + 1) * row] for r in range(4)]
            outer, inner = rows[0] + rows[3], rows[1] + rows[2]
            groups += [outer + inner] if per_node // tp == 1 else [outer, inner]
        return groups
    if tp == 4 and hardware == "TRN1":  # trn1's tp 4: each group strided over a node's ranks
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        n = local // tp
        return [[base + j + n * i for i in range(tp)] for base in range(0, world_size, local) for j in range(n)]
    return [ranks[i:i + tp] for i in range(0, world_size, tp)]


def initialize_model_parallel(
    tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1,
    context_parallel_size=1,
    expert_model_parallel_size=1,
    skip_collective_init=False,
    lnc_size=1,
    mesh_only=False,
):
    global _TP_SIZE, _DP_SIZE, _TP_GROUPS, _REPLICA_LOGIC
    assert torch.distributed.is_initialized()
    hardware = _hardware()
    rebuilt = _TP_SIZE is not None
    world_size = torch.distributed.get_world_size()
    tp = min(tensor_model_parallel_size, world_size)
    pp = min(pipeline_model_parallel_size, world_size)
    cp = min(context_parallel_size, world_size)
    ep = min(expert_model_parallel_size, world_size)
    if world_size % (tp * pp * cp) != 0:
        raise RuntimeError(f"invalid implied data parallel degree: `world_size` ({world_size}) is not divisible by ...")
    if world_size % (tp * pp * ep) != 0:
        raise RuntimeError(f"invalid implied expert data parallel degree: `world_size` ({world_size}) is not ...")
    cpu_mode = int(os.environ.get("NXD_CPU_MODE", "0")) > 0
    collectives = not skip_collective_init and not cpu_mode and not mesh_only
    if collectives:  # the real one's collective set-up: one all-reduce over the world on the XLA device
        import torch_xla.core.xla_model as xm

        xm.mark_step()
        temp = torch.rand([1], device="xla")
        torch.distributed.all_reduce(temp, group=torch.distributed.group.WORLD)
        xm.mark_step()
    _REPLICA_LOGIC = _replica_logic(lnc_size, hardware, tp, world_size)
    groups = _tp_groups(_REPLICA_LOGIC, hardware, tp, world_size)
    fields = dict(
        tensor_model_parallel_size=tensor_model_parallel_size, effective_tp=tp, mesh_only=mesh_only,
        skip_collective_init=skip_collective_init, collectives_initialised=collectives, lnc_size=lnc_size,
        replica_logic=_REPLICA_LOGIC,
    )
    if mesh_only:
        _record("initialize_model_parallel", rebuilt=False, **fields)
        return types.SimpleNamespace(tp_groups=groups)
    _TP_SIZE = tp
    _DP_SIZE = world_size // (tp * pp * cp)
    _TP_GROUPS = groups
    _record("initialize_model_parallel", rebuilt=rebuilt, **fields)


def model_parallel_is_initialized():
    return _TP_SIZE is not None


def get_tensor_model_parallel_size():
    assert _TP_SIZE is not None, "intra_layer_model parallel group is not initialized"
    return _TP_SIZE


def get_tensor_model_parallel_replica_groups():
    assert _TP_GROUPS is not None, "intra_layer_model parallel group is not initialized"
    return _TP_GROUPS


def get_tensor_model_parallel_rank():
    assert _TP_SIZE is not None, "intra_layer_model parallel group is not initialized"
    rank = torch.distributed.get_rank()
    group = next(g for g in _TP_GROUPS if rank in g)
    return sorted(group).index(rank)  # torch numbers a new group's ranks in ascending order


def get_data_parallel_size():
    assert _DP_SIZE is not None, "data parallel group is not initialized"
    return _DP_SIZE


def get_expert_model_parallel_size():
    assert _TP_SIZE is not None, "intra_layer_model parallel group is not initialized"
    return 1


def destroy_model_parallel():
    global _TP_SIZE, _DP_SIZE, _TP_GROUPS
    _TP_SIZE = _DP_SIZE = _TP_GROUPS = None
    _record("destroy_model_parallel")
'''

#: torch_neuronx.utils: ``get_platform_target`` reads NEURON_PLATFORM_TARGET_OVERRIDE first, as the real one.
UTILS_SOURCE = '''"""Stand-in for torch_neuronx.utils: the platform from NEURON_PLATFORM_TARGET_OVERRIDE, else trn1."""
import os


def get_platform_target(compiler_args=None):
    return os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
'''

PACKAGES = {
    "torch_neuronx/__init__.py": '"""Stand-in for torch-neuronx (the Neuron SDK cannot be installed here)."""\n',
    "torch_neuronx/utils.py": UTILS_SOURCE,
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
    utils = types.ModuleType("torch_neuronx.utils")
    exec(compile(UTILS_SOURCE, "<torch_neuronx.utils stand-in>", "exec"), utils.__dict__)
    monkeypatch.setattr(packages["torch_neuronx"], "utils", utils, raising=False)
    monkeypatch.setitem(sys.modules, "torch_neuronx.utils", utils)
    state.__spec__ = importlib.machinery.ModuleSpec(state.__name__, loader=None)
    monkeypatch.setattr(packages["neuronx_distributed.parallel_layers"], "parallel_state", state, raising=False)
    monkeypatch.setitem(sys.modules, state.__name__, state)
    return state
