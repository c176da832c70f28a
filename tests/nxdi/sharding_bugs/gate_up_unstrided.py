"""A fused tensor split in the wrong order before sharding: layer 1's experts' fused gate/up
projection ([gate; up] along the intermediate size) sharded in contiguous blocks instead of
each rank taking its block of gate and its block of up (stride 2): on two ranks, rank 0
holds both halves of gate."""

from __future__ import annotations

from neuronx_distributed_inference.models.mixtral.modeling_mixtral import (
    NeuronMixtralDecoderLayer,
    NeuronMixtralForCausalLM,
    NeuronMixtralModel,
)

from . import BUGGY_LAYER


class GateUpUnstridedDecoderLayer(NeuronMixtralDecoderLayer):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        if layer_idx == BUGGY_LAYER:
            self.mlp.expert_mlps.mlp_op.gate_up_proj.weight.partition_stride = 1


class GateUpUnstridedModel(NeuronMixtralModel):
    pass


class GateUpUnstridedForCausalLM(NeuronMixtralForCausalLM):
    _model_cls = GateUpUnstridedModel
