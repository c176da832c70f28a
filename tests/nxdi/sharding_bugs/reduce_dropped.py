"""A row-parallel projection without its all-reduce: the MLP's down projection of layer 1
returns each rank's partial sum (in one process the sum is the whole)."""

from __future__ import annotations

from neuronx_distributed_inference.models.llama.modeling_llama import (
    NeuronLlamaDecoderLayer,
    NeuronLlamaForCausalLM,
    NeuronLlamaModel,
)

from . import BUGGY_LAYER


class ReduceDroppedDecoderLayer(NeuronLlamaDecoderLayer):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config)
        if layer_idx == BUGGY_LAYER:
            self.mlp.down_proj.reduce_output = False


class ReduceDroppedModel(NeuronLlamaModel):
    pass


class ReduceDroppedForCausalLM(NeuronLlamaForCausalLM):
    _model_cls = ReduceDroppedModel
