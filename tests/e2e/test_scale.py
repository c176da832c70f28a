"""Layer streaming, single-layer loading, placement options, --plan and the dtype audit."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file
from support import DEFAULT_MODEL

from pytest_layerparity.options import parse_max_memory, size_bytes
from pytest_layerparity.reference.audit import dtype_audit


def _extract(pytester, store, *args):
    result = pytester.runpytest(
        "--gpu-golden", "--extract", f"--model={DEFAULT_MODEL}", f"--golden-dir={store}", "--dtype", "bfloat16", *args
    )
    result.assert_outcomes(passed=6)
    return result


def test_streaming_goldens_equal_whole_model_goldens_bit_for_bit(pytester):
    _extract(pytester, "stream", "--device-map", "stream")
    _extract(pytester, "whole", "--device-map", "cpu")
    files = sorted(p.name for p in (pytester.path / "stream").glob("layer_*.safetensors"))
    assert len(files) == 18  # 6 layers: the prompt and 2 decode steps each
    for name in files:
        assert (pytester.path / "stream" / name).read_bytes() == (pytester.path / "whole" / name).read_bytes(), name
    # model_io: the same inputs; only the whole model keeps its logits apart (model_logits, not streamed)
    streamed, whole = (load_file(pytester.path / d / "model_io.safetensors") for d in ("stream", "whole"))
    for name in ("input_ids", "embeddings", "decode_ids"):
        assert torch.equal(streamed[name], whole[name]), name
    assert streamed["logits"].shape[:2] == streamed["input_ids"].shape  # every position's, back from disk
    assert not list((pytester.path / "stream").glob(".layerparity-calls-*"))  # the spilled logits and KV cache: gone
    assert (pytester.path / "whole" / "model_logits.safetensors").exists()
    assert not (pytester.path / "stream" / "model_logits.safetensors").exists()


def test_header_names_the_placement(pytester):
    result = _extract(pytester, "s", "--device-map", "stream")
    result.stdout.fnmatch_lines(
        [
            "layerparity: reference device cpu (no CUDA visible), dtype bfloat16, placement stream*",
            "reference placement: stream on cpu",
        ]
    )


def test_single_layer_test_opens_only_the_shards_of_that_layer(pytester):
    """Layer 2's test reads its shards only: every other shard may be missing."""
    from pytest_layerparity.model.checkpoint import Checkpoint

    model = pytester.path / "model"
    shutil.copytree(DEFAULT_MODEL, model)
    checkpoint = Checkpoint.open(model)
    needed = set(checkpoint.files_for(checkpoint.layer_keys("model.layers", 2)))
    removed = [p for p in model.glob("*.safetensors") if p.name not in needed]
    assert removed  # the layer does not span every shard
    for path in removed:
        path.unlink()
    goldens = pytester.path / "goldens"
    shutil.copytree(DEFAULT_MODEL.parent / "goldens" / "minimax_m2_tiny", goldens)
    result = pytester.runpytest("--target", "cpu", f"--model={model}", f"--golden-dir={goldens}", "-k", "layer_2")
    result.assert_outcomes(passed=2, deselected=11)  # layer 2's prompt and decode-step tests


@pytest.mark.parametrize(
    ("text", "gpus", "expected"),
    [
        ("40GB", 3, {0: "40GB", 1: "40GB", 2: "40GB"}),
        ("40GB", 0, {"cpu": "40GB"}),
        ("0:60GB,1:60GB,2:40GB", 3, {0: "60GB", 1: "60GB", 2: "40GB"}),
        ("0:60GB, cpu:100GiB", 1, {0: "60GB", "cpu": "100GiB"}),
    ],
)
def test_max_memory_forms(text, gpus, expected):
    assert parse_max_memory(text, gpus=gpus) == expected


@pytest.mark.parametrize("text", ["", "40", "0:60", "x:1GB", "0:60GB,1", "lots"])
def test_max_memory_errors(text):
    with pytest.raises(ValueError):
        parse_max_memory(text, gpus=2)


def test_size_units():
    assert size_bytes("1.5GB") == 1_500_000_000
    assert size_bytes("2 GiB") == 2 * 2**30


def test_plan_reads_headers_only(pytester):
    """--plan works on shards cut right after their headers: no weight is read."""
    import struct

    model = pytester.path / "model"
    shutil.copytree(DEFAULT_MODEL, model)
    for shard in model.glob("*.safetensors"):
        data = shard.read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        shard.write_bytes(data[: 8 + length])
    result = pytester.runpytest("--plan", f"--model={model}", "--dtype", "bfloat16", "--seq-len", "128")
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "layerparity plan: * (minimax_m2, 6 layers), dtype bfloat16, batch 1, seq 128",
            "  weights on disk by dtype: BF16 2.19 MB",
            "  weights as bfloat16: 2.19 MB; largest layer: layer 0, 0.32 MB; outside the layers: 0.26 MB",
            "  activations (batch x seq x hidden x layers x bytes): 0.10 MB",
            "  KV cache (2 x batch x layers x seq x kv_heads x head_dim x bytes): 0.10 MB",
            "  devices: cpu * free",
            "    whole model on cpu: needs * fits",
            "    --device-map stream on cpu: needs * fits",
            "      tensors the run allocates, at its peak in each layer's goldens: *",
            "        the largest layer: 0.32 MB",
            "        loading it, or one layer's activations (the widest pass: the floor's or the envelope's) where *",
            "        one captured call (hidden states in and out): 0.03 MB",
            "      beside them, the run's own (the allocator's free lists and threads' heaps, *): 10.00 MB",
        ]
    )


def test_plan_leaves_torch_xla_out(pytester, monkeypatch):
    """--plan is the reference side's: torch-xla, installed for --xla, is not imported by
    accelerate for it (no "Defaulting to PJRT_DEVICE=CPU" warning, and none of its memory in
    the plan's measured imports)."""
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.delenv("USE_TORCH_XLA", raising=False)  # (an earlier in-process run may have set it)
    result = pytester.runpytest_subprocess("--plan", f"--model={DEFAULT_MODEL}", "-p", "no:cacheprovider")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["layerparity plan: * (minimax_m2, 6 layers), dtype bfloat16, batch 1, seq 32"])
    assert "PJRT_DEVICE" not in result.stdout.str() + result.stderr.str()


def test_dtype_audit_refuses_a_float32_layer_under_a_bf16_request():
    layer = torch.nn.Sequential(torch.nn.Linear(64, 64).to(torch.bfloat16), torch.nn.Linear(64, 256))
    audit = dtype_audit(layer, torch.bfloat16)
    assert audit.fatal
    assert audit.message.startswith("would materialise in float32 under a bfloat16 request (")
    assert "1.weight (float32, [256, 64])" in audit.message
    small = torch.nn.Linear(64, 64).to(torch.bfloat16)
    small.register_buffer("bias_fp32", torch.zeros(4))
    report = dtype_audit(small, torch.bfloat16)
    assert not report.fatal and report.odd == [("bias_fp32", "float32", (4,))]
