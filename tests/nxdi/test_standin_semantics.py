"""The recording stand-in of ``parallel_state`` that tests/e2e uses on the XLA device (where
the real one needs the Neuron SDK's process group) answers as the real one, run here in NxD's
CPU mode on a gloo group: the same sequence of calls, the same answers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))


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
    ]
    ps.initialize_model_parallel(tensor_model_parallel_size=4, skip_collective_init=True)  # rebuilt, capped at 1
    seen += [ps.model_parallel_is_initialized(), ps.get_tensor_model_parallel_size()]
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
    assert real == [False, True, 1, 0, 1, 1, True, 1, False]
    assert standin == real
