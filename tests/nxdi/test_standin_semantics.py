"""The recording stand-in of ``parallel_state`` that tests/e2e uses on the XLA device (where
the real one needs the Neuron SDK's process group) answers as the real one, run here in NxD's
CPU mode on a gloo group, in ModelBuilder's mocked world of many ranks, and on a world of one
"xla" group on the torch-xla CPU device: the same sequence of calls, the same answers, the same
replica groups for each logical NeuronCore config, the same collective set-up."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))


def logic(ps) -> str:
    """The replica-group layout NxD chose (an enum in the real one, its name in the stand-in)."""
    value = ps._REPLICA_LOGIC
    return getattr(value, "name", value)


def sequence(ps) -> list:
    """What the plugin and NxDI's layers ask of parallel_state, in a world of one."""
    seen = [ps.model_parallel_is_initialized()]
    ps.initialize_model_parallel(tensor_model_parallel_size=1, skip_collective_init=True)
    seen += [
        ps.model_parallel_is_initialized(),
        ps.get_tensor_model_parallel_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_data_parallel_size(),
        ps.get_expert_model_parallel_size(),
        ps.get_tensor_model_parallel_replica_groups(),
        logic(ps),
    ]
    ps.initialize_model_parallel(tensor_model_parallel_size=4, skip_collective_init=True, lnc_size=2)  # rebuilt
    seen += [ps.model_parallel_is_initialized(), ps.get_tensor_model_parallel_size(), logic(ps)]
    ps.destroy_model_parallel()
    seen.append(ps.model_parallel_is_initialized())
    return seen


@pytest.fixture
def world_of_one():
    from pytest_layerparity.backends.neuron import apply_env_defaults, restore_env

    applied = apply_env_defaults()
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    restore_env(applied)


def test_standin_answers_as_the_real_parallel_state(world_of_one):
    from neuronx_distributed.parallel_layers import parallel_state
    from standin_neuron_sdk import recording_parallel_state

    real = sequence(parallel_state)
    standin = sequence(recording_parallel_state())
    assert real == [False, True, 1, 0, 1, 1, [[0]], "LOGIC1", True, 1, "LOGIC1", False]
    assert standin == real


#: (tp, lnc_size) on Trn2 in a world of 64: the real one's table (get_logic_chosen) lays LNC 1 at
#: tp 64 and LNC 2 at tp 32 over the outer and inner rows of the cores, the others contiguously.
LAYOUTS = [(64, 1), (64, 2), (32, 2), (32, 1), (8, 2), (2, 1)]


def laid_out(ps) -> list:
    """Each (tp, lnc_size)'s layout and tensor-parallel groups, in ModelBuilder's mocked world of
    64 ranks (``trace/mock_torchdist.py``, as ModelBuilder.trace sets it up)."""
    from neuronx_distributed.trace.mock_torchdist import mock_distributed

    seen = []
    for tp, lnc in LAYOUTS:
        with mock_distributed(world_size=64):
            torch.distributed.init_process_group(backend="xla", rank=0, world_size=64)
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, skip_collective_init=True, lnc_size=lnc)
            seen.append((tp, lnc, logic(ps), ps.get_tensor_model_parallel_replica_groups()))
            ps.destroy_model_parallel()
            torch.distributed.destroy_process_group()
    return seen


def test_standin_lays_the_groups_out_for_the_lnc_as_the_real_one_on_trn2(monkeypatch):
    from neuronx_distributed.parallel_layers import parallel_state
    from standin_neuron_sdk import recording_parallel_state

    from pytest_layerparity.ports.nxdi import nxd_warnings_quiet

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with nxd_warnings_quiet():
        real = laid_out(parallel_state)
    standin = laid_out(recording_parallel_state())
    assert [(tp, lnc, layout) for tp, lnc, layout, _ in real] == [
        (64, 1, "LOGIC2"),
        (64, 2, "LOGIC1"),
        (32, 2, "LOGIC2"),
        (32, 1, "LOGIC1"),
        (8, 2, "LOGIC1"),
        (2, 1, "LOGIC1"),
    ]
    assert real[0][3] == [[*range(16), *range(48, 64), *range(16, 48)]]  # tp 64 at LNC 1: rows 0, 3, 1, 2
    assert standin == real


def collective_inits(ps, monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[str, bool]]]:
    """The all-reduces ``initialize_model_parallel`` makes (device, over the world?) as the
    plugin's ``--neuron --port hf`` calls it (collectives initialised), with
    ``skip_collective_init=True`` and in NxD's CPU mode."""
    seen: list[tuple[str, bool]] = []
    all_reduce = dist.all_reduce

    def recorded(tensor, *args, group=None, **kwargs):
        seen.append((tensor.device.type, group is dist.group.WORLD))
        return all_reduce(tensor, *args, group=group, **kwargs)

    made = []
    with monkeypatch.context() as patched:
        patched.setattr(dist, "all_reduce", recorded)
        for skip, cpu_mode in ((False, "0"), (True, "0"), (False, "1")):
            patched.setenv("NXD_CPU_MODE", cpu_mode)
            ps.initialize_model_parallel(tensor_model_parallel_size=1, skip_collective_init=skip)
            ps.destroy_model_parallel()
            made.append(list(seen))
            seen.clear()
    return made


@pytest.fixture
def xla_world_of_one():
    import torch_xla.distributed.xla_backend  # noqa: F401

    from pytest_layerparity.backends.neuron import apply_env_defaults, restore_env

    applied = apply_env_defaults()
    dist.init_process_group("xla", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    restore_env(applied)


def test_standin_initialises_the_collectives_where_the_real_one_does(xla_world_of_one, monkeypatch):
    from neuronx_distributed.parallel_layers import parallel_state
    from standin_neuron_sdk import recording_parallel_state

    from pytest_layerparity.ports.nxdi import nxd_warnings_quiet

    with nxd_warnings_quiet():  # both call torch-xla's deprecated mark_step around the all-reduce
        real = collective_inits(parallel_state, monkeypatch)
        standin = collective_inits(recording_parallel_state(), monkeypatch)
    assert real == [[("xla", True)], [], []]
    assert standin == real
