"""Checkpoints read from disk (model.checkpoint.Checkpoint, and the plan's reading of them),
each on a checkpoint written for it: rows read where the header places them, tensors read as
private maps of their shard, a cut or unreadable shard named, and the plan's block of the head
or tied weights (moved from unit/test_streaming.py, which reads the embedded model alone)."""

from __future__ import annotations

import pytest
import torch
from support import DEFAULT_MODEL as MODEL

from pytest_layerparity.model import streaming
from pytest_layerparity.model.checkpoint import Checkpoint
from pytest_layerparity.model.source import ModelSource


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

    from pytest_layerparity.errors import ModelError

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


def test_a_checkpoints_tensors_are_read_as_private_maps_of_their_shard(tmp_path, mapped_from_a_file):
    from safetensors.torch import save_file

    from pytest_layerparity.errors import ModelError

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
    assert mapped_from_a_file(read["c"]) and mapped_from_a_file(read["a"])
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
