from __future__ import annotations

import json

import pytest
import torch

from pytest_layerparity.store.golden import GoldenError, GoldenStore


@pytest.fixture
def store(tmp_path):
    store = GoldenStore(tmp_path / "store")
    store.begin({"dtype": "float32", "model": {"num_layers": 2}}, compare_keys=("dtype", "model.num_layers"))
    store.write("layer_0", {"output": torch.arange(6.0).reshape(2, 3)}, {"call": {"x": 1}})
    return store


def test_write_then_load_round_trips(store):
    entry = store.load("layer_0")
    assert torch.equal(entry.tensors["output"], torch.arange(6.0).reshape(2, 3))
    assert entry.metadata == {"call": {"x": 1}}
    manifest = json.loads(store.manifest_path.read_text())
    assert manifest["schema_version"] == 2
    assert manifest["files"]["layer_0"]["file"] == "layer_00000.safetensors"
    assert len(manifest["files"]["layer_0"]["sha256"]) == 64
    assert not list(store.root.glob("*.tmp"))


def test_flipped_byte_is_refused_naming_the_file(store):
    path = store.root / "layer_00000.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(GoldenError) as info:
        store.load("layer_0")
    assert str(path) in str(info.value)
    assert "does not match the manifest" in str(info.value)
    assert "pytest --gpu-golden --extract --golden-dir=" in str(info.value)


def test_truncated_file_is_refused(store):
    path = store.root / "layer_00000.safetensors"
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(GoldenError, match=r"layer_00000\.safetensors: sha256"):
        store.load("layer_0")


def test_missing_entry_names_the_command(store):
    with pytest.raises(GoldenError, match="no golden for layer_5; extract it with: X"):
        store.load("layer_5", missing_hint="extract it with: X")


def test_manifest_paths_cannot_escape_the_store(store, tmp_path):
    manifest = json.loads(store.manifest_path.read_text())
    (tmp_path / "outside.safetensors").write_bytes(b"x")
    manifest["files"]["layer_1"] = {"file": "../outside.safetensors", "sha256": "0"}
    store.manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(GoldenError, match="not a plain safetensors file name inside the store"):
        store.load("layer_1")


def test_unknown_schema_is_refused(store):
    manifest = json.loads(store.manifest_path.read_text())
    manifest["schema_version"] = 99
    store.manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(GoldenError, match="schema version 99 is not one this pytest-layerparity reads"):
        store.load("layer_0")


def test_a_schema_1_store_reads_its_floor_under_the_current_names(store):
    floor = {
        "ref_output": torch.ones(2, 3),
        "ref_routing.mlp.gate.scores": torch.zeros(2, 4),
        "ref_cache.new_keys": torch.ones(1, 1, 1, 2),
    }
    store.write("layer_1", {"output": torch.zeros(2, 3), **floor}, {"call": {"x": 1}})
    manifest = json.loads(store.manifest_path.read_text())
    manifest["schema_version"] = 1
    store.manifest_path.write_text(json.dumps(manifest))
    tensors = store.load("layer_1").tensors
    assert sorted(tensors) == ["floor.cache.new_keys", "floor.output", "floor.routing.mlp.gate.scores", "output"]
    assert torch.equal(tensors["floor.output"], torch.ones(2, 3))
    # extracting into it again: the store becomes schema 2, its old entries still read
    store.begin({"dtype": "float32", "model": {"num_layers": 2}}, compare_keys=("dtype", "model.num_layers"))
    assert json.loads(store.manifest_path.read_text())["schema_version"] == 2
    assert "floor.output" in store.load("layer_1").tensors and "output" in store.load("layer_0").tensors


def test_nan_is_refused_at_write_and_at_load(store):
    with pytest.raises(ValueError, match=r"layer_1: tensor 'output' holds NaN \(first at index \(0, 1\)\)"):
        store.write("layer_1", {"output": torch.tensor([[0.0, float("nan")]])}, {})
    # a mask may hold -inf; hidden states may not
    store.write("layer_1", {"kwargs.attention_mask": torch.tensor([0.0, float("-inf")]), "output": torch.ones(2)}, {})
    with pytest.raises(ValueError, match="holds Inf"):
        store.write("layer_1", {"output": torch.tensor([float("inf")])}, {})


def test_other_extraction_is_refused(store):
    with pytest.raises(GoldenError, match="dtype: store has 'float32', this run has 'bfloat16'"):
        store.begin({"dtype": "bfloat16", "model": {"num_layers": 2}}, compare_keys=("dtype", "model.num_layers"))
    store.begin(
        {"dtype": "float32", "model": {"num_layers": 2}, "note": "new"}, compare_keys=("dtype", "model.num_layers")
    )
    assert store.read_manifest()["note"] == "new"
    assert store.has("layer_0")


def test_not_json_manifest(store):
    store.manifest_path.write_text("{")
    with pytest.raises(GoldenError, match="the manifest is not valid JSON"):
        store.read_manifest()


# -- --force-regen ------------------------------------------------------------------------------


def _store(path, text):
    path.mkdir()
    (path / "manifest.json").write_text(text)


@pytest.mark.parametrize("complete", [True, False])
def test_regeneration_keeps_the_old_store_until_the_new_one_is_complete(tmp_path, complete):
    from pytest_layerparity.store.regen import Regeneration

    root = tmp_path / "goldens"
    _store(root, "old")
    regen = Regeneration(root)
    regen.start()
    assert not root.exists() and (tmp_path / "goldens.previous" / "manifest.json").read_text() == "old"
    _store(root, "new")
    line = regen.finish(complete)
    assert (root / "manifest.json").read_text() == ("new" if complete else "old")
    assert not (tmp_path / "goldens.previous").exists()
    assert ("replaced" if complete else "put back") in line
    assert regen.finish(complete) is None  # once


def test_regeneration_of_no_store_and_of_a_leftover(tmp_path):
    from pytest_layerparity.store.regen import Regeneration

    root = tmp_path / "goldens"
    regen = Regeneration(root)
    regen.start()
    _store(root, "partial")
    assert "there was no store before" in regen.finish(False)
    assert (root / "manifest.json").read_text() == "partial"
    _store(tmp_path / "goldens.previous", "stale leftover")
    regen = Regeneration(root)
    regen.start()  # the leftover of an interrupted regeneration is older than the store: it goes
    assert (tmp_path / "goldens.previous" / "manifest.json").read_text() == "partial"
