"""The NxDI port's pure parts, without NxDI: the stand-ins for the closed-source Neuron
packages, the config fields transformers 4 reads, and pairing a port's router with the
golden's. (NxDI itself is tested in tests/nxdi, in its own environment.)"""

from __future__ import annotations

import pytest
import torch

from pytest_layerparity.compare.judge import paired_routers
from pytest_layerparity.model.build import transformers_4_names
from pytest_layerparity.ports import standins


def test_placeholders_import_subclass_and_decorate_but_refuse_tensors():
    jit = standins.Placeholder("nki.jit")

    @jit
    def kernel(x):
        return x + 1

    assert kernel(1) == 2  # a decorator at import time keeps the function
    assert isinstance(jit(mode="auto"), standins.Placeholder)  # a decorator factory
    assert repr(standins.Placeholder("nki.language").par_dim) == "<stand-in nki.language.par_dim>"

    class Sub(standins.Placeholder("torch_neuronx.Base")):  # subclassing a stood-in class
        pass

    assert Sub.__mro__[-1] is object
    with pytest.raises(standins.NeuronOnlyError, match=r"nkilib\.core\.mlp needs the Neuron SDK"):
        standins.Placeholder("nkilib.core.mlp")(torch.ones(2))


def test_layer_boundary_markers_are_the_identity_and_other_hlo_calls_refuse():
    def hlo_builder(module, qualname):
        def forward_impl(*args):
            raise AssertionError("never built on the CPU")

        forward_impl.__module__, forward_impl.__qualname__ = module, qualname
        return standins.xla_hlo_call(forward_impl)

    marker = hlo_builder("neuronx_distributed_inference.models.layer_boundary_marker", "ModuleMarkerStart.forward_impl")
    x, y = torch.ones(2), torch.zeros(3)
    assert marker(x) is x
    assert marker(x, y) == (x, y)
    other = hlo_builder("some_port.kernels", "ModuleMarkerStart.forward_impl")  # the name alone is not enough
    with pytest.raises(standins.NeuronOnlyError, match=r"ModuleMarkerStart\.forward_impl builds an HLO custom call"):
        other(x)


def test_platform_target_reads_the_override_like_torch_neuronx(monkeypatch):
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    assert standins.platform_target() == "trn1"
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    assert standins.platform_target("--target trn1") == "trn2"


def test_collectives_config_gives_each_rank_its_ring_neighbour():
    config = standins.CollectivesConfig(replica_groups=[[0, 1, 2], [3]])
    assert config.rank_src_tgt_pairs == {0: [[2, 0]], 1: [[0, 1]], 2: [[1, 2]], 3: [[3, 3]]}


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, {"rope_theta": 5e5}),
        (
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
            {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
        ),
        ({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 5e5}}, {}),  # the old name wins where present
        ({"num_local_experts": 8, "dtype": "bfloat16"}, {"num_experts": 8, "torch_dtype": "bfloat16"}),
        ({"num_experts": 8, "torch_dtype": "float32"}, {"num_local_experts": 8, "dtype": "float32"}),
        (
            {"rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.5}},
            {"rope_theta": 1e6, "partial_rotary_factor": 0.5},
        ),
        ({"hidden_size": 64}, {}),
    ],
)
def test_fields_transformers_4_reads_under_old_names(config, expected):
    assert transformers_4_names(config) == expected


def test_a_port_router_named_otherwise_is_paired_with_the_golden_one():
    target = {
        "routing.layer.mlp.router.indices": torch.zeros(2, 2),
        "routing.layer.mlp.router.logits": torch.ones(2, 4),
    }
    paired = paired_routers(["mlp.gate"], target)
    assert sorted(paired) == ["routing.mlp.gate.indices", "routing.mlp.gate.logits"]
    assert paired_routers(["mlp.gate", "mlp.shared_gate"], target) is target  # ambiguous: left alone
    assert paired_routers(["layer.mlp.router"], target) is target
