"""Key/value heads laid out for the wrong query group: layer 1's K and V projections are
placed over the ranks one rank off (rank r's query heads get rank r + 1's KV head), as a
replication or placement of KV heads for the ranks in the wrong order does."""

from __future__ import annotations

from neuronx_distributed_inference.models.llama.modeling_llama import (
    NeuronLlamaDecoderLayer,
    NeuronLlamaForCausalLM,
    NeuronLlamaModel,
)

from . import BUGGY_LAYER, rank_blocks_rolled


class KvHeadsMisplacedDecoderLayer(NeuronLlamaDecoderLayer):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config)
        if layer_idx == BUGGY_LAYER:
            qkv = self.self_attn.qkv_proj
            place_heads = qkv.preshard_hook

            def misplaced(state, prefix):
                place_heads(state, prefix)
                for key in [k for k in state if k.endswith(("qkv_proj.k_proj.weight", "qkv_proj.v_proj.weight"))]:
                    state[key] = rank_blocks_rolled(state[key], 0)

            qkv.preshard_hook = misplaced


class KvHeadsMisplacedModel(NeuronLlamaModel):
    pass


class KvHeadsMisplacedForCausalLM(NeuronLlamaForCausalLM):
    _model_cls = KvHeadsMisplacedModel
