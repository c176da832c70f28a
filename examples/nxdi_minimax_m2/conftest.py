"""Test neuronx-distributed-inference's MiniMax-M2 decoder layer, layer by layer, against the
HuggingFace goldens: the ``pytest_layerparity_build_target_layer`` hook for the NxDI port.

NxDI's MiniMax-M2 port is contributed code: ``contrib/models/MiniMax-M2/src/modeling_minimax_m2.py``
(neuronx-distributed-inference pull request 138; pull request 119 carries the same module as
``neuronx_distributed_inference.models.minimax_m2.modeling_minimax_m2``). Put it on the path
with ``NXDI_MINIMAX_M2_SRC`` (the folder that holds ``modeling_minimax_m2.py``), or install an
NxDI that has it, then on a Trainium instance::

    export NXDI_MINIMAX_M2_SRC=$HOME/neuronx-distributed-inference/contrib/models/MiniMax-M2/src
    pytest --neuron --model=/models/MiniMax-M2 --golden-dir=/goldens/mm2 --layers 0-3
    torchrun --nproc_per_node=4 -m pytest --neuron --tp-degree 4 --model=/models/MiniMax-M2 --golden-dir=/goldens/mm2

For each layer, the hook:

1. builds ``NeuronMiniMaxM2DecoderLayer`` from a ``MiniMaxM2InferenceConfig`` made of the
   HuggingFace config (NxDI's ``load_pretrained_config``) and a ``MoENeuronConfig`` with the
   session's tensor-parallel degree, batch, sequence length and dtype; the plugin has already
   set up ``torch.distributed`` and ``parallel_state``, which NxDI's layers require;
2. converts the layer's HuggingFace weights to NxDI's names: first back to the names of the
   released checkpoint (``block_sparse_moe.experts.E.w1/w2/w3``, ``block_sparse_moe.gate``,
   ...), which is what NxDI's converter reads, then through NxDI's own
   ``convert_minimax_m2_hf_to_neuron_state_dict`` (experts stacked into
   ``expert_mlps.mlp_op.gate_up_proj`` / ``down_proj``, the router renamed, q/k projections
   nested under ``qkv_proj``, q/k norms padded for tensor parallelism), then neuronx-distributed's
   ``get_sharded_checkpoint`` (preshard hooks such as ``o_proj.weight`` ->
   ``o_proj.o_proj.weight``, and this rank's shard);
3. wraps it so that it takes the HuggingFace layer's call (hidden states, rotary cos/sin,
   position ids) and makes NxDI's context-encoding call: a boolean causal mask, the position
   ids (NxDI computes its own rotary embedding from them, so the port's RoPE is under test
   too), no KV cache. Its first output, the hidden states, is compared with the golden.

Nothing NxDI is imported until a layer is built, so the module imports without the Neuron SDK.
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
import warnings
from typing import Any

import pytest
import torch

NXDI_MODULE = "neuronx_distributed_inference.models.minimax_m2.modeling_minimax_m2"


def import_nxdi_minimax_m2() -> Any:
    """NxDI's MiniMax-M2 modeling module: the installed one, else the contrib folder named by
    NXDI_MINIMAX_M2_SRC."""
    try:
        return importlib.import_module(NXDI_MODULE)
    except ImportError:
        pass
    src = os.environ.get("NXDI_MINIMAX_M2_SRC")
    if not src:
        raise ImportError(
            f"NxDI's MiniMax-M2 port is not importable as {NXDI_MODULE}; set NXDI_MINIMAX_M2_SRC to the folder "
            "holding its modeling_minimax_m2.py (neuronx-distributed-inference/contrib/models/MiniMax-M2/src)"
        )
    if src not in sys.path:
        sys.path.insert(0, src)
    return importlib.import_module("modeling_minimax_m2")


# -- weights ----------------------------------------------------------------------------------


def hf_layer_to_checkpoint_names(state_dict: dict[str, torch.Tensor], layer_idx: int) -> dict[str, torch.Tensor]:
    """A transformers (>= 5) ``MiniMaxM2DecoderLayer`` state dict, under the names of the
    released MiniMax-M2 checkpoint for layer ``layer_idx`` without the ``model.`` prefix (NxDI
    strips it before its converter runs). transformers fuses each expert's w1 (gate) and w3 (up)
    into ``mlp.experts.gate_up_proj[e] = cat(w1, w3)`` and stacks w2 into ``down_proj``; this
    undoes that."""
    prefix = f"layers.{layer_idx}."
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name.startswith(("self_attn.", "input_layernorm.", "post_attention_layernorm.")):
            out[prefix + name] = tensor
        elif name == "mlp.gate.weight":
            out[prefix + "block_sparse_moe.gate.weight"] = tensor
        elif name == "mlp.e_score_correction_bias":
            out[prefix + "block_sparse_moe.e_score_correction_bias"] = tensor
        elif name == "mlp.experts.gate_up_proj":
            intermediate = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}block_sparse_moe.experts.{e}.w1.weight"] = tensor[e, :intermediate]
                out[f"{prefix}block_sparse_moe.experts.{e}.w3.weight"] = tensor[e, intermediate:]
        elif name == "mlp.experts.down_proj":
            for e in range(tensor.shape[0]):
                out[f"{prefix}block_sparse_moe.experts.{e}.w2.weight"] = tensor[e]
        else:
            raise KeyError(f"layer {layer_idx}: no MiniMax-M2 checkpoint name known for {name!r}")
    return out


def nxdi_layer_state_dict(modeling: Any, reference_layer: torch.nn.Module, nxdi_config: Any) -> dict[str, torch.Tensor]:
    """The layer's weights under NxDI's names, relative to ``NeuronMiniMaxM2DecoderLayer``,
    converted by NxDI's own converter (run on this one layer, as layer 0 of a one-layer config,
    so that the converter's per-layer loops see only it)."""
    checkpoint = hf_layer_to_checkpoint_names(
        {k: v.detach().clone() for k, v in reference_layer.state_dict().items()}, 0
    )
    one_layer = copy.copy(nxdi_config)
    one_layer.num_hidden_layers = 1
    converted = modeling.convert_minimax_m2_hf_to_neuron_state_dict(checkpoint, one_layer)
    return {k[len("layers.0.") :]: v for k, v in converted.items() if k.startswith("layers.0.")}


# -- config -------------------------------------------------------------------------------------


def nxdi_config(
    modeling: Any, model_config: Any, *, tp_degree: int, batch_size: int, seq_len: int, dtype: torch.dtype
) -> Any:
    """``MiniMaxM2InferenceConfig`` for context encoding of one (batch_size, seq_len) call."""
    from neuronx_distributed_inference.models.config import MoENeuronConfig
    from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

    hf = copy.deepcopy(model_config)
    # transformers 5 keeps these under other names than the released config.json NxDI reads.
    rope = getattr(hf, "rope_parameters", None) or {}
    if getattr(hf, "rope_theta", None) is None:
        hf.rope_theta = rope.get("rope_theta", 10000.0)
    if getattr(hf, "rotary_dim", None) is None:
        hf.rotary_dim = int(hf.head_dim * rope.get("partial_rotary_factor", 1.0))
    if getattr(hf, "use_qk_norm", None) is None:
        hf.use_qk_norm = True  # transformers' MiniMaxM2Attention always has q_norm / k_norm
    neuron_config = MoENeuronConfig(tp_degree=tp_degree, batch_size=batch_size, seq_len=seq_len, torch_dtype=dtype)
    neuron_config.is_prefill_stage = True  # context encoding (NxDI sets it in enable_context_encoding())
    return modeling.MiniMaxM2InferenceConfig(neuron_config, load_config=load_pretrained_config(hf_config=hf))


# -- the call -----------------------------------------------------------------------------------


class HFCallToNxDI(torch.nn.Module):
    """Takes the HuggingFace decoder layer's call and makes NxDI's context-encoding call."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Any = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **_: Any,
    ) -> torch.Tensor:
        batch, seq, _ = hidden_states.shape
        device = hidden_states.device
        if attention_mask is None or attention_mask.dim() != 4:
            # NxDI's prefill keeps scores where the mask is True.
            mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()[None, None].expand(batch, 1, seq, seq)
        elif attention_mask.dtype == torch.bool:
            mask = attention_mask
        else:
            mask = attention_mask == 0  # HF's additive mask: 0 where attended
        if position_ids is None:
            position_ids = torch.arange(seq, device=device)[None].expand(batch, seq)
        outputs = self.layer(hidden_states, attention_mask=mask, position_ids=position_ids, past_key_value=None)
        return outputs[0]


# -- the hook -----------------------------------------------------------------------------------


@pytest.hookimpl
def pytest_layerparity_build_target_layer(
    layer_idx: int, reference_layer: torch.nn.Module, model_config: Any, device: Any
) -> Any:
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.trace.trace import get_sharded_checkpoint

    modeling = import_nxdi_minimax_m2()
    batch_size, seq_len = _golden_input_shape()
    dtype = next(reference_layer.parameters()).dtype
    tp = parallel_state.get_tensor_model_parallel_size()
    config = nxdi_config(modeling, model_config, tp_degree=tp, batch_size=batch_size, seq_len=seq_len, dtype=dtype)
    layer = modeling.NeuronMiniMaxM2DecoderLayer(config, layer_idx)
    state = nxdi_layer_state_dict(modeling, reference_layer, config)
    with warnings.catch_warnings():
        # neuronx-distributed warns "Removing redundant keys from checkpoint: [...]" on every
        # call, which a project's filterwarnings = error would turn into a failure.
        warnings.filterwarnings("ignore", message="Removing redundant keys from checkpoint")
        get_sharded_checkpoint(state, layer, parallel_state.get_tensor_model_parallel_rank(), tp)
    missing, _ = layer.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("rank_util.rank")]
    if missing:
        raise RuntimeError(f"layer {layer_idx}: NxDI parameters without a converted weight: {missing}")
    return HFCallToNxDI(layer).eval().to(device)


def _golden_input_shape() -> tuple[int, int]:
    """(batch size, sequence length) of the goldens' input (the stored input ids)."""
    from pytest_layerparity.state import SESSION_KEY

    batch_size, seq_len = _CONFIG[0].stash[SESSION_KEY].reference.stored_input_ids().shape
    return int(batch_size), int(seq_len)


_CONFIG: list[Any] = []


def pytest_configure(config: pytest.Config) -> None:
    _CONFIG[:] = [config]
