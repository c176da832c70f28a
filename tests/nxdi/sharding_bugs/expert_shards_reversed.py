"""Expert intermediate shards joined out of order: layer 1's experts' down projection is
placed over the ranks one rank off along the intermediate size, so each rank's down
projection meets another rank's gate/up outputs."""

from __future__ import annotations

from neuronx_distributed_inference.models.mixtral.modeling_mixtral import (
    NeuronMixtralDecoderLayer,
    NeuronMixtralForCausalLM,
    NeuronMixtralModel,
)

from . import BUGGY_LAYER, rank_blocks_rolled


class ExpertShardsReversedDecoderLayer(NeuronMixtralDecoderLayer):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        if layer_idx == BUGGY_LAYER:
            experts = self.mlp.expert_mlps
            prepare = experts.preshard_hook

            def out_of_order(state, prefix):
                prepare(state, prefix)
                key = f"{prefix.removesuffix('weight')}mlp_op.down_proj.weight"
                state[key] = rank_blocks_rolled(state[key], 1)  # [experts, intermediate, hidden]

            experts.preshard_hook = out_of_order


class ExpertShardsReversedModel(NeuronMixtralModel):
    pass


class ExpertShardsReversedForCausalLM(NeuronMixtralForCausalLM):
    _model_cls = ExpertShardsReversedModel
