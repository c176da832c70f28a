"""The wider passes' dense MLP and norms over blocks of tokens: the same output as the whole
prompt's at once, one block's intermediates held, mixtures of experts, the attention and
modules that do not keep their input's shape left whole, the layer as it was afterwards."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MixtralConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

from pytest_layerparity.noise.perturb import PerturbedArithmetic
from pytest_layerparity.noise.tokens import block_rows, in_token_blocks, per_token_children
from pytest_layerparity.noise.wider import WiderArithmetic

CONFIG = {
    "hidden_size": 32,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def _llama_layer(dtype: torch.dtype) -> tuple[LlamaDecoderLayer, LlamaConfig]:
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG)
    config._attn_implementation = "eager"
    return LlamaDecoderLayer(config, 0).to(dtype).eval(), config


def _call(config: LlamaConfig, dtype: torch.dtype, tokens: int) -> tuple[torch.Tensor, dict]:
    hidden = torch.randn(2, tokens, config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    positions = torch.arange(tokens).unsqueeze(0)
    cos, sin = LlamaRotaryEmbedding(config)(hidden, positions)
    return hidden, {"position_embeddings": (cos.to(dtype), sin.to(dtype)), "attention_mask": None}


@pytest.mark.parametrize(("narrow", "wide"), [(torch.bfloat16, torch.float32), (torch.float32, torch.float64)])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_the_floor_over_token_blocks_computes_what_it_computes_whole(narrow, wide, tokens):
    layer, config = _llama_layer(narrow)
    hidden, kwargs = _call(config, narrow, tokens)
    widened = {"position_embeddings": tuple(t.to(wide) for t in kwargs["position_embeddings"])}
    rows, norm_rows = [], []
    handle = layer.mlp.gate_proj.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[-2]))
    original = layer.input_layernorm.forward

    def counted(x):
        norm_rows.append(x.shape[-2])
        return original(x)

    layer.input_layernorm.forward = counted  # a forward of its own: what the blocks wrap, and restore
    elements = 2 * 96 * 3  # three tokens a block, batch 2
    with torch.no_grad(), WiderArithmetic(wide):
        whole = layer(hidden.to(wide), **widened)
        calls = len(rows)
        with in_token_blocks(layer, elements):
            blocked = layer(hidden.to(wide), **widened)
    handle.remove()
    assert layer.input_layernorm.__dict__["forward"] is counted
    del layer.input_layernorm.forward
    assert calls == 1 and rows[0] == tokens and norm_rows[0] == tokens
    assert rows[1:] == [3] * (tokens // 3) + ([tokens % 3] if tokens % 3 else [])
    assert norm_rows[1:] == [9] * (tokens // 9) + ([tokens % 9] if tokens % 9 else [])  # 32 wide
    assert blocked.dtype == wide and blocked.shape == whole.shape
    torch.testing.assert_close(blocked, whole)
    assert not any("forward" in child.__dict__ for child in layer.children())  # the layer is as it was


def test_a_perturbed_run_over_token_blocks_stays_within_rounding_of_the_plain_one():
    layer, config = _llama_layer(torch.bfloat16)
    hidden, kwargs = _call(config, torch.bfloat16, 40)
    with torch.no_grad():
        plain = layer(hidden, **kwargs).float()
        with in_token_blocks(layer, 2 * 96 * 5), PerturbedArithmetic(3):
            perturbed = layer(hidden, **kwargs).float()
    assert perturbed.dtype == torch.float32 and not torch.equal(perturbed, plain)
    assert ((perturbed - plain).abs() <= 0.05 * plain.abs() + 0.05).all()


def test_a_mixture_of_experts_and_the_attention_are_left_whole():
    llama, _ = _llama_layer(torch.float32)
    norms = [("input_layernorm", 0), ("post_attention_layernorm", 0)]
    assert [(name, width) for name, _, width in per_token_children(llama)] == [("mlp", 96), *norms]
    config = MixtralConfig(**CONFIG, num_local_experts=4, num_experts_per_tok=2)
    assert [(name, width) for name, _, width in per_token_children(MixtralDecoderLayer(config, 0))] == norms


class Pooling(torch.nn.Module):
    """An 'MLP' that mixes tokens: its output has one row, whatever its input."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.mean(-2, keepdim=True))


class Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = Pooling()


def test_a_child_whose_output_is_not_token_by_token_runs_whole():
    holder = Holder()
    x = torch.randn(10, 8)
    with torch.no_grad():
        want = holder.mlp(x)
        with in_token_blocks(holder, 3 * 8):  # three tokens a block
            got = holder.mlp(x)
    torch.testing.assert_close(got, want)
    assert "forward" not in holder.mlp.__dict__


class Named(torch.nn.Module):
    """An MLP its layer calls by keyword, as DBRX's calls ``ffn(hidden_states=...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.calls = torch.nn.Linear(8, 32), []

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.calls.append(hidden_states.shape[-2])
        return self.up(hidden_states).relu()[..., :8]


def test_a_child_called_by_keyword_runs_in_blocks():
    holder = Holder()
    holder.mlp = Named()
    x = torch.randn(1, 10, 8)
    with torch.no_grad():
        want = holder.mlp(hidden_states=x)
        with in_token_blocks(holder, 3 * 32):  # three tokens a block
            got = holder.mlp(hidden_states=x)
    torch.testing.assert_close(got, want)
    assert holder.mlp.calls == [10, 3, 3, 3, 1]


@pytest.mark.parametrize(
    ("shape", "width", "elements", "rows"),
    [((1, 2048, 1536), 4096, 1 << 20, 256), ((4, 2048, 64), 4096, 1 << 20, 64), ((9, 64), 10**9, 1 << 20, 1)],
)
def test_block_rows(shape, width, elements, rows):
    assert block_rows(torch.Size(shape), width, elements) == rows
