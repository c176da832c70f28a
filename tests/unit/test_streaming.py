"""Layer streaming (model.streaming): the embedding reads only the rows of the tokens it
is called with, the head reads its weight a block of rows at a time, and the streamed forward
computes what the whole model computes, bit for bit, on the embedded model as committed (what
needs a checkpoint written for it: e2e/test_streaming_checkpoints.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from pytest_layerparity.model import streaming
from pytest_layerparity.model.checkpoint import Checkpoint
from pytest_layerparity.model.source import ModelSource
from pytest_layerparity.reference.spill import mapped_empty

MODEL = Path(__file__).resolve().parents[2] / "fixtures" / "minimax_m2_tiny"


@pytest.mark.parametrize(("fraction", "mapped"), [(streaming.ROW_BLOCK_FRACTION, False), (0.01, False), (0.01, True)])
def test_streamed_forward_reads_rows_and_equals_the_whole_model(
    monkeypatch, tmp_path, fraction, mapped, mapped_from_a_file
):
    monkeypatch.setattr(streaming, "ROW_BLOCK_FRACTION", fraction)
    whole_model = ModelSource(MODEL).skeleton(torch.bfloat16)
    checkpoint = Checkpoint.open(MODEL)
    checkpoint.load_into(whole_model, list(checkpoint.weight_map), torch.bfloat16)
    ids = torch.tensor([[5, 6, 7, 900, 5, 31, 32, 1000]])
    with torch.no_grad():
        expected = whole_model(input_ids=ids, use_cache=False).logits

    rows, whole = [], []
    read_rows, read = Checkpoint.read_rows, Checkpoint.read

    def reading_rows(self, key, ranges):
        rows.append((key, list(ranges)))
        return read_rows(self, key, ranges)

    def reading(self, keys):
        keys = list(keys)
        whole.extend(keys)
        return read(self, keys)

    monkeypatch.setattr(Checkpoint, "read_rows", reading_rows)
    monkeypatch.setattr(Checkpoint, "read", reading)
    model = ModelSource(MODEL).skeleton(torch.bfloat16)
    empty = functools.partial(mapped_empty, tmp_path / "spill") if mapped else None
    with torch.no_grad(), streaming.streamed(model, checkpoint, "model.layers", torch.bfloat16, "cpu", empty=empty):
        logits = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(logits, expected)
    if mapped:  # the head wrote into a file-backed map, its file already removed
        assert mapped_from_a_file(logits) and not list((tmp_path / "spill").iterdir())

    assert "model.embed_tokens.weight" not in whole and "lm_head.weight" not in whole
    embedding = [r for key, r in rows if key == "model.embed_tokens.weight"]
    assert embedding == [[(5, 8), (31, 33), (900, 901), (1000, 1001)]]  # the prompt's distinct ids, in runs
    head = [r for key, r in rows if key == "lm_head.weight"]
    vocab, hidden = 1024, 64
    layer = max(
        sum(t.numel() for t in checkpoint.read(checkpoint.layer_keys("model.layers", i)).values()) for i in range(6)
    )
    step = max(1, int(fraction * layer) // max(hidden, ids.numel()))
    assert [block for (block,) in head] == [(s, min(s + step, vocab)) for s in range(0, vocab, step)]
    if fraction < 0.1:
        assert len(head) > 1
    # every weight given back, the modules as they were
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.model.embed_tokens.weight.shape == (vocab, hidden)
    assert "forward" not in model.lm_head.__dict__


def test_a_tied_embedding_is_read_whole_once():
    """Tied embeddings cannot be told apart by module: loaded once up front, not by rows."""
    from types import SimpleNamespace

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(8, 4)
    model.head = torch.nn.Linear(4, 8, bias=False)
    model.config = SimpleNamespace(tie_word_embeddings=True)
    model._tied_weights_keys = {"head.weight": "embed.weight"}
    model.layers = torch.nn.ModuleList()
    checkpoint = Checkpoint(Path("."), {"embed.weight": "x.safetensors"})
    plan = streaming.plan_units(model, checkpoint, "layers")
    units = {u.path: u for u in plan.units}
    assert units["embed"].resident and units["embed"].by_rows() is None
    assert units["head"].by_rows() is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_loaded_layer_is_the_processs_own_memory_not_its_checkpoints_map(dtype, mapped_from_a_file):
    from safetensors import safe_open

    source = ModelSource(MODEL)
    layer = source.load_layer(1, dtype)
    tensors = [*layer.parameters(), *layer.buffers()]
    assert tensors and not any(mapped_from_a_file(t) for t in tensors if t.numel())
    # the values are the checkpoint's: a weight the loader takes as stored (no conversion)
    key = next(k for k in source.checkpoint.layer_keys(source.layer_list[0], 1) if k.endswith("input_layernorm.weight"))
    with safe_open(str(MODEL / source.checkpoint.weight_map[key]), "pt") as handle:
        stored = handle.get_tensor(key)
    assert torch.equal(layer.input_layernorm.weight.detach(), stored.to(dtype))
