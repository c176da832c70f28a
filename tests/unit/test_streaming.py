"""Layer streaming (reference.streaming): the embedding reads only the rows of the tokens it
is called with, the head reads its weight a block of rows at a time, and the streamed forward
computes what the whole model computes, bit for bit."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from pytest_layerparity.reference import streaming
from pytest_layerparity.reference.model import Checkpoint, ModelSource
from pytest_layerparity.reference.spill import mapped_empty

MODEL = Path(__file__).resolve().parents[2] / "fixtures" / "minimax_m2_tiny"


@pytest.mark.parametrize(("fraction", "mapped"), [(streaming.ROW_BLOCK_FRACTION, False), (0.01, False), (0.01, True)])
def test_streamed_forward_reads_rows_and_equals_the_whole_model(monkeypatch, tmp_path, fraction, mapped):
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
        assert _mapped_from_a_file(logits) and not list((tmp_path / "spill").iterdir())

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


def _mapped_from_a_file(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory lies in a file mapping of this process (/proc/self/maps)."""
    address = tensor.untyped_storage().data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, _, _, _, inode, *_ = [*line.split(), ""]
        low, high = (int(x, 16) for x in span.split("-"))
        if low <= address < high:
            return inode != "0"
    return False


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


@pytest.mark.parametrize("tied", [False, True])
def test_the_plan_counts_a_block_of_the_head_or_tied_weights_whole(tmp_path, monkeypatch, tied):
    """--plan counts what streaming holds outside the layers: a block of rows of the largest
    matrix (half the largest layer at most), or, tied, the matrix whole through the forward."""
    import json
    import shutil

    from pytest_layerparity.reference.plan import make_plan

    model = tmp_path / "model"
    shutil.copytree(MODEL, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": tied}))
    plan = make_plan(ModelSource(model), "bfloat16", 1, 8)
    matrix = 1024 * 64 * 2
    if tied:
        assert plan.resident == matrix
    else:
        assert plan.resident == 0
        block = int(streaming.ROW_BLOCK_FRACTION * plan.largest_layer[1] // 2) * 2
        assert plan.largest_outside == min(matrix, block)
    import pytest_layerparity.reference.plan as planning

    monkeypatch.setattr(planning, "ROW_BLOCK_FRACTION", 0.1)  # a smaller block: the plan follows it
    smaller = make_plan(ModelSource(model), "bfloat16", 1, 8)
    expected = matrix if tied else int(0.1 * plan.largest_layer[1] // 2) * 2
    assert (smaller.resident if tied else smaller.largest_outside) == expected


def test_rows_are_read_where_the_header_places_them_and_a_cut_shard_is_named(tmp_path):
    from safetensors.torch import save_file

    from pytest_layerparity.reference.model import ModelError

    tensors = {
        "a": torch.arange(40, dtype=torch.float32).reshape(10, 4),
        "b": torch.randn(6, 3, 2).to(torch.bfloat16),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    checkpoint = Checkpoint.open(tmp_path)
    for key, tensor in tensors.items():
        parts = checkpoint.read_rows(key, [(0, 1), (2, 5)])
        assert torch.equal(parts[0], tensor[0:1]) and torch.equal(parts[1], tensor[2:5])
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-8])
    cut = Checkpoint(tmp_path, dict.fromkeys(tensors, "model.safetensors"))  # (open() would refuse the file)
    last = max(tensors, key=lambda k: cut.headers([k])[k]["data_offsets"][1])
    with pytest.raises(ModelError, match=f"model.safetensors: {last} is cut short"):
        cut.read_rows(last, [(0, len(tensors[last]))])


def test_a_checkpoints_tensors_are_read_as_private_maps_of_their_shard(tmp_path):
    from safetensors.torch import save_file

    from pytest_layerparity.reference.model import ModelError

    g = torch.Generator().manual_seed(4)
    tensors = {
        "a": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(1000, 300, generator=g),  # spans pages: mapped from the page it starts on
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    before = (tmp_path / "model.safetensors").read_bytes()
    read = Checkpoint.open(tmp_path).read(tensors)
    for key, want in tensors.items():
        assert read[key].dtype == want.dtype and torch.equal(read[key], want), key
    assert _mapped_from_a_file(read["c"]) and _mapped_from_a_file(read["a"])
    read["c"].mul_(2)  # a write copies the page: the checkpoint is as it was
    assert (tmp_path / "model.safetensors").read_bytes() == before

    (tmp_path / "model.safetensors").write_bytes(before[: len(before) - 100])  # cut short
    with pytest.raises(ModelError, match=r"model\.safetensors: c is cut short"):
        Checkpoint.open(tmp_path).read(["c"])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors.index.json").write_text('{"weight_map": {"a": "x.safetensors"}}')
    (broken / "x.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ModelError, match=r"x\.safetensors: not a readable safetensors file"):
        Checkpoint.open(broken).read(["a"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_loaded_layer_is_the_processs_own_memory_not_its_checkpoints_map(dtype):
    from safetensors import safe_open

    source = ModelSource(MODEL)
    layer = source.load_layer(1, dtype)
    tensors = [*layer.parameters(), *layer.buffers()]
    assert tensors and not any(_mapped_from_a_file(t) for t in tensors if t.numel())
    # the values are the checkpoint's: a weight the loader takes as stored (no conversion)
    key = next(k for k in source.checkpoint.layer_keys(source.layer_list[0], 1) if k.endswith("input_layernorm.weight"))
    with safe_open(str(MODEL / source.checkpoint.weight_map[key]), "pt") as handle:
        stored = handle.get_tensor(key)
    assert torch.equal(layer.input_layernorm.weight.detach(), stored.to(dtype))
