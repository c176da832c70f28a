"""What bounds extraction's memory, as table tests: the precision floor computed without a
wider copy of the layer, captured calls kept on disk, the chunked finite check, and the
plan's account of what streaming extraction allocates (what is measured, in a process of its
own or on a written checkpoint: e2e/test_memory_measured.py)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from pytest_layerparity.noise import perturb, rounding, wider
from pytest_layerparity.noise.wider import WiderArithmetic, query_block
from pytest_layerparity.reference.plan import (
    BRANCH_OUTPUTS,
    FLOOR_OUTPUT,
    FORWARD,
    GOLDENS,
    KV_ONE_LAYER,
    LOAD_OR_ACTIVATIONS,
    LOAD_OR_WIDEST,
    RUN_OUTPUT,
    Plan,
    RunOptions,
    layer_activations,
    perturbed_op_peak,
    stream_extraction_needs,
    widest_weight,
)
from pytest_layerparity.reference.spill import SpilledCalls
from pytest_layerparity.store.callspec import CallRecord
from pytest_layerparity.store.finite import all_finite_by_sum, check_finite


class Block(torch.nn.Module):
    """An RMSNorm, a stacked-experts weight indexed per expert, an in-place op on a buffer
    made in the weight's dtype, and a cast to the weight's dtype."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.norm = torch.nn.Parameter(1 + 0.1 * torch.randn(16, generator=g))
        self.experts = torch.nn.Parameter(torch.randn(4, 16, 16, generator=g) / 4)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        out = torch.zeros(x.shape, dtype=self.experts.dtype)
        for e in range(4):
            out += torch.nn.functional.linear(h, self.experts[e]).softmax(-1)
        return self.proj(out.to(self.proj.weight.dtype)) + x


@pytest.mark.parametrize(("narrow", "wide"), [(torch.bfloat16, torch.float32), (torch.float32, torch.float64)])
def test_wider_arithmetic_computes_what_the_widened_module_computes(narrow, wide):
    block = Block().to(narrow)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1)).to(narrow)
    expected = Block().to(narrow).to(wide)
    expected.load_state_dict({k: v.to(wide) for k, v in block.state_dict().items()})
    with torch.no_grad():
        want = expected(x.to(wide))
        with WiderArithmetic(wide):
            got = block(x.to(wide))
        plain = block(x)
    assert got.dtype == wide
    assert all(p.dtype == narrow for p in block.parameters())  # no wider copy of the weights kept
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(plain.to(wide), want)  # the narrow run is not it


@pytest.mark.parametrize(
    ("narrow", "wide", "tol"), [(torch.bfloat16, torch.float32, 1e-6), (torch.float32, torch.float64, 1e-13)]
)
@pytest.mark.parametrize("bias", ["none", "row", "full"])
def test_a_large_weight_is_widened_a_block_of_columns_at_a_time(monkeypatch, narrow, wide, tol, bias):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(6, 40, generator=g).to(narrow), torch.randn(40, 50, generator=g).to(narrow)
    c = {"none": None, "row": torch.randn(50, generator=g), "full": torch.randn(6, 50, generator=g)}[bias]
    widened = []

    def widen(value):
        if isinstance(value, torch.Tensor) and value.dtype == narrow:
            widened.append(value.numel())
            return value.to(wide)
        return value

    monkeypatch.setattr(wider, "WIDEN_BLOCK", 400)  # ten columns of b a block
    if c is None:
        got = wider.widened_matmul(torch.ops.aten.mm.default, (a, b), {}, widen)
        want = a.to(wide) @ b.to(wide)
    else:
        c = c.to(narrow)
        got = wider.widened_matmul(torch.ops.aten.addmm.default, (c, a, b), {"beta": 0.5}, widen)
        want = torch.addmm(c.to(wide), a.to(wide), b.to(wide), beta=0.5)
    assert got.dtype == wide
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert a.numel() in widened and max(widened) == 400 and widened.count(400) == 5  # a whole, b ten columns a time
    assert wider.widened_matmul(torch.ops.aten.mm.default, (a, b[:, :10]), {}, widen) is None  # small: whole


def test_the_floor_and_a_perturbed_run_of_a_large_linear_widen_it_in_blocks(monkeypatch):
    linear = torch.nn.Linear(40, 50).to(torch.bfloat16)
    x = torch.randn(3, 4, 40, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
        with perturb.PerturbedArithmetic(0):
            whole = linear(x)  # the weight widened whole (below WIDEN_BLOCK)
        monkeypatch.setattr(wider, "WIDEN_BLOCK", 40 * 7)
        with WiderArithmetic(torch.float32):
            got = linear(x.float())
        with perturb.PerturbedArithmetic(0):
            blocked = linear(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # float32's own reduction orders apart
    assert blocked.dtype == torch.bfloat16 and not torch.equal(blocked, want.to(torch.bfloat16))
    # the same draws on the same wider result: equal, but where float32's orders tip a rounding
    assert (blocked == whole).float().mean() > 0.95
    assert ((blocked.float() - whole.float()).abs() <= 2**-7 * whole.float().abs()).all()


def test_spilled_calls_round_trip_and_leave_nothing_behind(tmp_path):
    calls = SpilledCalls(tmp_path)
    a = torch.arange(12.0).reshape(3, 4)
    calls[0] = CallRecord(tensors={"args.0": a[:, 1:], "mask": torch.ones(2, dtype=torch.bool)}, spec={"n": 1})
    calls[(1, 0)] = CallRecord(tensors={"args.0": a}, spec={"n": 2})
    calls.add(0, {"routing.gate": torch.tensor([1, 2])})
    calls.add(5, {"ignored": torch.zeros(1)})  # no such call
    assert len(calls) == 2 and set(calls) == {0, (1, 0)}
    record = calls[0]
    assert record.spec == {"n": 1}
    assert torch.equal(record.tensors["args.0"], a[:, 1:]) and record.tensors["mask"].dtype == torch.bool
    assert torch.equal(record.tensors["routing.gate"], torch.tensor([1, 2]))
    folder = calls.folder
    assert folder.parent == tmp_path and len(list(folder.iterdir())) == 2
    del calls[0]
    assert len(list(folder.iterdir())) == 1
    del calls[(1, 0)]
    assert not folder.exists() and list(tmp_path.iterdir()) == []


def test_the_finite_check_in_chunks_finds_what_one_sum_finds():
    t = torch.randn(1000, dtype=torch.bfloat16)
    assert all_finite_by_sum(t, chunk=7)
    t[999] = float("nan")
    assert not all_finite_by_sum(t, chunk=7)
    with pytest.raises(ValueError, match="holds NaN"):
        check_finite("layer_0", {"hidden_states": t})


CONFIG = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 1000,
}


def test_layer_activations_count_the_widest_tensors():
    dense = layer_activations(CONFIG, 1, 8, 2, eager_attention=False)
    # residual stream 4 x 8 x 64, q/k/v and copies (2 x 8 x 64 + 4 x 8 x 32 + 8 x 64), MLP 3 x 8 x 128; 2 bytes
    assert dense == (4 * 512 + (2 * 512 + 4 * 256) + 512 + 3 * 1024) * 2
    eager = layer_activations(CONFIG, 1, 8, 2, eager_attention=True)
    assert eager - dense == 4 * 8 * 8 * (2 + 4)  # the scores and their float32 softmax
    moe = layer_activations({**CONFIG, "num_local_experts": 8, "num_experts_per_tok": 2}, 1, 8, 2, False)
    assert moe - dense == 8 * 2 * (3 * 128 + 64) * 2 + 8 * 8 * 4 - 3 * 8 * 128 * 2
    assert layer_activations(CONFIG, 1, 16, 2, False) == 2 * dense  # linear in tokens without eager attention
    # the floor's and the envelope's passes run the experts one at a time: one expert's share
    # of the tokens (8 x 2 / 8), and the output they add into
    one = layer_activations({**CONFIG, "num_local_experts": 8, "num_experts_per_tok": 2}, 1, 8, 2, False, True)
    assert moe - one == (8 * 2 - 2) * (3 * 128 + 64) * 2 - 8 * 64 * 2
    assert layer_activations(CONFIG, 1, 8, 2, False, True) == dense  # a dense MLP of one block: the same
    # past a block (2**20 elements of the widest intermediate: 8192 tokens of 128), a dense
    # MLP's intermediates are one block's, and its output is written block by block
    long = layer_activations(CONFIG, 1, 3 * 8192, 2, False, True)
    assert layer_activations(CONFIG, 1, 3 * 8192, 2, False) - long == 3 * 2 * 8192 * 128 * 2 - 3 * 8192 * 64 * 2


def test_the_wider_passes_hold_a_block_of_tokens_and_widen_a_block_of_a_weight():
    wide = {**CONFIG, "hidden_size": 2048, "intermediate_size": 4096}
    assert widest_weight(wide) == 2**20  # the MLP's up projection, 8M elements: a block of its columns
    seq = 4096  # norms: 512 tokens of 2048 a block; the MLP: 256 tokens of 4096
    block = rounding.ROUNDING_BLOCK  # the rounding's temporaries: one block's
    norm = 2 * 512 * 2048 * 8 + block * (3 * 8 + 4 + 1)
    mlp = 2 * 256 * 4096 * 4 + block * (3 * 4 + 2 + 1)
    q, kv = seq * 4 * 16, seq * 2 * 16
    attention = (3 * q + 2 * kv) * 4 + 2 * 4 * query_block(seq, 16, seq) * seq * 4
    assert perturbed_op_peak(wide, 1, seq, 2, False) == max(norm, mlp, attention) + 2**20 * 4


def test_stream_extraction_needs_name_every_term_and_follow_the_options():
    plan = Plan(0, (0, 10_000), 5_000, 0, 4_000, {}, largest_outside=10_000_000, logits=1_000, kv_layer=500)
    phase, full = stream_extraction_needs(plan, CONFIG, "bfloat16", 1, 8, RunOptions(decode_steps=2))
    assert phase == FORWARD  # the embeddings outweigh a layer and its passes over 8 tokens (12 runs: 96)
    assert full["the largest unit"] == 10_000_000
    assert full[LOAD_OR_ACTIVATIONS] == 10_000_000  # loading the embeddings outweighs a plain pass over 8 tokens
    assert full[KV_ONE_LAYER] == 500  # the other layers' on disk
    assert "the prompt's logits" not in full  # the head's activations: on disk once the forward returns
    wide_vocab = dataclasses.replace(plan, logits=30_000_000)
    assert (
        stream_extraction_needs(wide_vocab, CONFIG, "bfloat16", 1, 8, RunOptions())[1][LOAD_OR_ACTIVATIONS]
        == 30_000_000
    )
    # streaming on the CPU writes the logits into a file-backed map: not the process's memory
    mapped = stream_extraction_needs(wide_vocab, CONFIG, "bfloat16", 1, 8, RunOptions(logits_mapped=True))[1]
    assert mapped[LOAD_OR_ACTIVATIONS] == 10_000_000
    # a layer as the largest unit: loading it adds what the loader reads beside it
    layered = dataclasses.replace(plan, largest_layer=(0, 200_000), load_extra=30_000, largest_outside=100_000)
    bare = RunOptions(precision_floor=False, envelope=False)
    assert stream_extraction_needs(layered, CONFIG, "bfloat16", 1, 8, bare)[1][LOAD_OR_ACTIVATIONS] == 30_000
    no_floor = RunOptions(precision_floor=False, envelope=False)
    # a small layer: the goldens' phase (the floor's and the envelope's passes) is the peak
    small = Plan(0, (0, 10), 5_000, 0, 4_000, {}, largest_outside=0, logits=1_000)
    phase, goldens = stream_extraction_needs(small, CONFIG, "bfloat16", 1, 8, RunOptions(decode_steps=2))
    assert phase == GOLDENS and goldens["the largest layer"] == 10
    assert goldens["one captured call (hidden states in and out)"] == 2 * 8 * 64 * 2
    plain = layer_activations(CONFIG, 1, 8, 2, False)
    assert goldens[LOAD_OR_WIDEST] > 2 * plain  # the run's tensors and the floor's, wider
    phase, bare = stream_extraction_needs(small, CONFIG, "bfloat16", 1, 8, no_floor)
    assert phase == FORWARD and bare[LOAD_OR_ACTIVATIONS] == plain  # no floor: no second phase to speak of
    assert bare[KV_ONE_LAYER] == 0


def test_the_widest_pass_is_the_floors_or_one_perturbed_op_at_a_time():
    tokens, hidden = 8, 64
    # the norms' float32 pass over the hidden states, widened to float64: the wider result
    # beside the widened input, then the rounding (error, point, mask) of a block, here all
    norm = 2 * tokens * hidden * 8 + tokens * hidden * (3 * 8 + 4 + 1)
    mlp = 2 * tokens * 128 * 4 + tokens * 128 * (3 * 4 + 2 + 1)  # the MLP's bf16 intermediate, widened
    # the math attention, widened: queries, output and its blocks (3 x 8 x 64), keys and
    # values (2 x 8 x 32), one block of 16 queries' scores and probabilities (2 x 4 x 8 x 8)
    attention = (3 * tokens * 64 + 2 * tokens * 32) * 4 + 2 * 4 * 8 * 8 * 4
    assert widest_weight(CONFIG) == 128 * 64  # the MLP's up projection
    assert perturbed_op_peak(CONFIG, 1, 8, 2, False) == max(norm, mlp, attention) + 128 * 64 * 4
    eager = perturbed_op_peak(CONFIG, 1, 8, 2, True)
    assert eager >= 4 * 8 * 8 * (2 * 8 + 3 * 8 + 4 + 1)  # the float32 softmax over every score, widened
    moe = {**CONFIG, "num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    assert widest_weight(moe) == 2 * 32 * 64  # one expert's gate and up projections
    small = Plan(0, (0, 10), 5_000, 0, 4_000, {}, largest_outside=0, logits=1_000)
    _, goldens = stream_extraction_needs(small, CONFIG, "bfloat16", 1, 8, RunOptions())
    # 8 tokens: the 12 runs go through the layer together (96 tokens), their outputs held
    assert goldens[FLOOR_OUTPUT] == 8 * 64 * 4 and goldens[RUN_OUTPUT] == 12 * 8 * 64 * 2
    # the attention's, the MLP's, the temperature's, the norms' epsilon's, bf16
    assert goldens[BRANCH_OUTPUTS] == 4 * 8 * 64 * 2
    # the floor's pass keeps the two branches' outputs in float32 beside its own tensors
    floor_pass = layer_activations(CONFIG, 1, 8, 4, False, True) + 128 * 64 * 4 + 2 * 8 * 64 * 4
    perturbed_pass = layer_activations(CONFIG, 12, 8, 2, False, True) + perturbed_op_peak(CONFIG, 12, 8, 2, False)
    assert goldens[LOAD_OR_WIDEST] == max(floor_pass, perturbed_pass)
    _, long = stream_extraction_needs(small, CONFIG, "bfloat16", 1, 512, RunOptions())
    assert long[RUN_OUTPUT] == 512 * 64 * 2  # a long prompt's runs one at a time: one run's, whatever K
    _, floor_only = stream_extraction_needs(small, CONFIG, "bfloat16", 1, 8, RunOptions(envelope=False))
    assert RUN_OUTPUT not in floor_only and floor_only[LOAD_OR_WIDEST] == floor_pass


def test_spilled_calls_give_each_file_a_name_of_its_own(tmp_path):
    calls = SpilledCalls(tmp_path)
    calls[0] = CallRecord(tensors={"a": torch.zeros(2)})
    calls[1] = CallRecord(tensors={"a": torch.ones(2)})
    del calls[0]
    calls[2] = CallRecord(tensors={"a": torch.full((2,), 2.0)})  # not the file of call 1
    calls[1] = CallRecord(tensors={"a": torch.full((2,), 3.0)})  # replaced: the old file goes
    assert [float(calls[k].tensors["a"][0]) for k in (1, 2)] == [3.0, 2.0]
    assert len(list(calls.folder.iterdir())) == 2


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _decode(model, spill=None, sink=None):
    """The prompt with a cache, then two greedy steps; each step's logits and the calls of
    layer 1 (its past keys captured)."""
    import contextlib

    from pytest_layerparity.capture.calls import capture_calls
    from pytest_layerparity.store.callspec import cache_argument, returned_cache

    layers = model.model.layers

    def hooks():
        return spill.hooks(layers) if spill is not None else contextlib.nullcontext()

    ids = torch.tensor([[3, 14, 15, 9, 2, 6]])
    with torch.no_grad(), hooks():
        out = model(input_ids=ids, use_cache=True)
    cache, logits, calls = returned_cache(out), [out.logits], []
    name = cache_argument(model.forward)
    for _ in range(2):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        with torch.no_grad(), capture_calls({1: layers[1]}, lambda i, r: calls.append(r)), hooks():
            out = model(input_ids=token, **{name: cache}, use_cache=True)
        logits.append(out.logits)
    return logits, calls, cache


def test_spilled_kv_cache_holds_one_layer_and_computes_the_same_bit_for_bit(tmp_path):
    from pytest_layerparity.reference.spill import SpilledKV

    model = _tiny_llama()
    want_logits, want_calls, _ = _decode(model)
    spill = SpilledKV(tmp_path)
    got_logits, got_calls, cache = _decode(model, spill)
    assert all(torch.equal(a, b) for a, b in zip(got_logits, want_logits, strict=True))
    for got, want in zip(got_calls, want_calls, strict=True):  # the capture saw the real past, and what was appended
        assert got.tensors.keys() == want.tensors.keys() and any("keys" in k for k in got.tensors)
        assert all(torch.equal(got.tensors[k], want.tensors[k]) for k in want.tensors)
    # between forwards every layer's keys and values are on disk; the cache keeps their shape
    assert [layer.keys.device.type for layer in cache.layers] == ["meta"] * 3
    assert cache.get_seq_length() == 8
    folder = spill._files.folder
    assert len(list(folder.iterdir())) == 3
    spill.close()
    assert not folder.exists()


def test_spilled_kv_cache_spills_and_restores_every_entry_a_layer_fills(tmp_path):
    """A layer of two attention blocks (cache entries 2i and 2i + 1): after it runs both of its
    entries go to disk, and both are back before it runs again."""
    from transformers.cache_utils import DynamicCache

    from pytest_layerparity.reference.spill import SpilledKV

    class Attention(torch.nn.Module):
        def __init__(self, index):
            super().__init__()
            self.index = index

        def forward(self, hidden, cache):
            keys, values = cache.update(hidden.unsqueeze(1) * 2, hidden.unsqueeze(1) * 3, self.index)
            return hidden + keys.sum(-2).squeeze(1) + values.mean(-2).squeeze(1)

    class Layer(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Attention(2 * i), Attention(2 * i + 1)])

        def forward(self, hidden, cache):
            return self.blocks[1](self.blocks[0](hidden, cache), cache)

    layers = torch.nn.ModuleList([Layer(0), Layer(1)])

    def run(spill, steps):
        cache, outs = DynamicCache(), []
        for hidden in steps:
            with spill.hooks(layers) if spill is not None else contextlib.nullcontext():
                for layer in layers:
                    hidden = layer(hidden, cache)
            outs.append(hidden)
        return outs, cache

    steps = [torch.randn(1, 3, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4)]
    want, _ = run(None, steps)
    spill = SpilledKV(tmp_path)
    got, cache = run(spill, steps)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert [entry.keys.device.type for entry in cache.layers] == ["meta"] * 4
    spill.close()
