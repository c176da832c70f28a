"""The stand-ins' signatures held against the real functions they stand in for, imported from
the vendored NxD and NxDI sources: a stand-in that accepted a call the real function refuses
(a name it does not have, a default it does not share) would let the plugin's wiring pass here
and fail on Trainium. Parameters are compared by name, order, kind and default (a default
function by its own parameters); annotations are not compared.

The calls the plugin makes are bound to the real signatures in ``test_compiled_port.py``
(``test_on_trn2_every_program_is_built_sharded_and_laid_out_for_one_lnc``: each recorded call to
``build_module``, ``ModelBuilder``, ``ModelBuilder.add`` and ``initialize_model_parallel``)."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))


def parameters(function: Any) -> list[tuple[str, str, Any]]:
    """Each parameter's name, kind and default (a function default as its parameter names)."""
    out = []
    for p in inspect.signature(function).parameters.values():
        default = p.default
        if callable(default) and default is not inspect.Parameter.empty:
            default = ("function of", tuple(inspect.signature(default).parameters))
        out.append((p.name, p.kind.name, default))
    return out


#: The parallel_state functions the e2e stand-in (RecordingParallelState) stands in for.
PARALLEL_STATE = (
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "get_tensor_model_parallel_size",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_replica_groups",
    "get_data_parallel_size",
    "get_expert_model_parallel_size",
    "destroy_model_parallel",
)


def standin_and_real(name: str) -> tuple[Any, Any]:
    """The stand-in named ``name`` and the real function it stands in for."""
    if name == "build_module":
        from neuronx_distributed_inference.utils.testing import build_module
        from standin_build_module import build_module as standin

        return standin, build_module
    if name == "nxd_model.initialize":
        from neuronx_distributed.trace.spmd import NxDModel
        from standin_build_module import StandinNxDModel

        return StandinNxDModel.initialize, NxDModel.initialize
    if name == "nxd_model.replace_weights":
        from neuronx_distributed.trace.nxd_model.nxd_model import NxDModel as NxDModelV2
        from standin_build_module import StandinNxDModelV2

        return StandinNxDModelV2.replace_weights, NxDModelV2.replace_weights
    from neuronx_distributed.parallel_layers import parallel_state
    from standin_neuron_sdk import recording_parallel_state

    function = name.removeprefix("parallel_state.")
    return getattr(recording_parallel_state(), function), getattr(parallel_state, function)


@pytest.mark.parametrize(
    "name",
    [
        "build_module",
        "nxd_model.initialize",
        "nxd_model.replace_weights",
        *(f"parallel_state.{f}" for f in PARALLEL_STATE),
    ],
)
def test_a_standin_takes_the_real_functions_parameters(name):
    standin, real = standin_and_real(name)
    assert parameters(standin) == parameters(real)


def test_a_drifted_signature_is_caught():
    """What the comparison sees: ``build_module`` with ``logical_nc_config`` defaulting to None
    (a stand-in that would accept the plugin leaving it out as the real one's default of 1 does
    not) differs."""
    from neuronx_distributed_inference.utils.testing import build_module

    def drifted(
        module_cls,
        example_inputs,
        module_init_kwargs={},  # noqa: B006
        tp_degree=1,
        world_size=None,
        local_ranks_size=None,
        compiler_args=None,
        compiler_workdir=None,
        checkpoint_path=None,
        priority_model_idx=0,
        logical_nc_config=None,
        dry_run=False,
        checkpoint_loader_fn=lambda checkpoint_path: None,
    ):
        pass

    ours, real = parameters(drifted), parameters(build_module)
    assert [p for p in ours if p not in real] == [("logical_nc_config", "POSITIONAL_OR_KEYWORD", None)]
