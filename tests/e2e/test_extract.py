"""`pytest --gpu-golden --extract` and `pytest --gpu-golden` on the embedded default model."""

from __future__ import annotations

import fnmatch
import json
import sys

import pytest
import torch
from safetensors.torch import load_file
from support import DEFAULT_MODEL, ROOT, printed_before_summary

from pytest_layerparity.noise.perturbed_runs import ENVELOPE_RULE

sys.path.insert(0, str(ROOT / "fixtures"))  # tiny_models


@pytest.fixture
def fresh(pytester):
    pytester.makeini(f"[pytest]\nlayerparity_model = {DEFAULT_MODEL}\nlayerparity_golden_dir = store\n")
    return pytester


def test_extract_writes_one_file_per_layer_and_the_manifest(fresh):
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2DecoderLayer

    from pytest_layerparity.store.callspec import cache_argument
    from pytest_layerparity.store.golden import GoldenStore

    result = fresh.runpytest(
        "--gpu-golden", "--extract", "--layers", "0-2", "--seq-len", "8", "--batch-size", "2", "-v"
    )
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(
        [
            "layerparity: reference device cpu (no CUDA visible), dtype bfloat16, placement cpu",
            "*test_extract_golden?layer_0? PASSED*",
            "*test_extract_golden?layer_2? PASSED*",
        ]
    )
    store = fresh.path / "store"
    assert sorted(p.name for p in store.glob("*.safetensors")) == [
        *(f"layer_0000{i}{step}.safetensors" for i in range(3) for step in (".decode_000", ".decode_001", "")),
        "model_io.safetensors",
        "model_logits.safetensors",
    ]
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["schema_version"] == 2
    assert manifest["dtype"] == "bfloat16" and manifest["reference_device"] == "cpu"  # the checkpoint's own
    assert manifest["inputs"] == {
        "source": "random",
        "seed": 0,
        "batch_size": 2,
        "seq_len": 8,
        "prompt": None,
        "decode_steps": 2,
    }
    assert manifest["model"]["num_layers"] == 6 and manifest["model"]["hidden_size"] == 64
    assert manifest["model"]["layer_module"] == "model.layers"
    assert len(manifest["model"]["config_sha256"]) == 64
    assert {"torch", "transformers"} <= set(manifest["versions"])
    assert set(manifest["files"]) == {
        *(f"layer_{i}{step}" for i in range(3) for step in ("", ".decode_0", ".decode_1")),
        "model_io",
        "model_logits",
    }
    layer = load_file(store / "layer_00001.safetensors")
    # the whole call: hidden states, rotary cos/sin, position ids, and the output
    assert layer["args.0"].shape == (2, 8, 64)
    assert layer["kwargs.position_embeddings.0"].shape[:2] == (1, 8)
    assert "kwargs.position_ids" in layer
    assert layer["output"].shape == (2, 8, 64)
    io = load_file(store / "model_io.safetensors")
    assert io["input_ids"].shape == (2, 8) and io["decode_ids"].shape == (2, 2) and "logits" not in io
    # the whole model's next-token logits, compact: 8 prompt and 2 decode positions, top 16
    logits = load_file(store / "model_logits.safetensors")
    assert logits["topk_ids"].shape == (2, 10, 16) and logits["logsumexp"].shape == (2, 10)
    assert torch.equal(logits["decode_ids"], io["decode_ids"])
    # the envelopes: 12 perturbed runs of each layer's call, 7 of the whole model
    goldens = GoldenStore(store)
    assert goldens.load("layer_1").metadata["envelope"]["samples"] == 12
    model_envelope = goldens.load("model_logits").metadata["envelope"]
    assert len(model_envelope["kl_median"]) == 7
    drift = model_envelope["margin_drift"]  # each run's largest shrink of a greedy margin: rounding-sized
    assert len(drift) == 7 and all(0 <= d < 1 for d in drift) and max(drift) > 0
    # a decode step: the new token's hidden state, the layer's past keys and values, what it appended
    step = load_file(store / "layer_00001.decode_001.safetensors")
    assert step["args.0"].shape == (2, 1, 64) and step["output"].shape == (2, 1, 64)
    past = f"kwargs.{cache_argument(MiniMaxM2DecoderLayer.forward)}.keys"  # under the installed transformers' name
    assert step[past].shape == (2, 2, 9, 16)  # 8 prompt tokens and the first step's
    assert step["cache.new_keys"].shape == step["cache.new_values"].shape == (2, 2, 1, 16)
    assert torch.equal(load_file(store / "layer_00000.safetensors")["args.0"], io["embeddings"])
    # layer 1's input is layer 0's output
    assert torch.equal(layer["args.0"], load_file(store / "layer_00000.safetensors")["output"])


def test_extract_adds_layers_without_losing_others(fresh):
    fresh.runpytest("--gpu-golden", "--extract", "--layers", "0").assert_outcomes(passed=1)
    fresh.runpytest("--gpu-golden", "--extract", "--layers", "4-5").assert_outcomes(passed=2)
    manifest = json.loads((fresh.path / "store" / "manifest.json").read_text())
    assert {k for k in manifest["files"] if ".decode_" not in k} == {
        "layer_0",
        "layer_4",
        "layer_5",
        "model_io",
        "model_logits",
    }
    assert {k for k in manifest["files"] if ".decode_" in k} == {
        f"layer_{i}.decode_{s}" for i in (0, 4, 5) for s in (0, 1)
    }


def test_extract_into_a_store_of_another_input_is_refused_once_at_start(fresh):
    fresh.runpytest("--gpu-golden", "--extract", "--layers", "0").assert_outcomes(passed=1)
    result = fresh.runpytest("--gpu-golden", "--extract", "--layers", "1", "--seq-len", "16")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: refusing the golden store: */store/manifest.json: this store holds goldens of another extraction "
            "(inputs.seq_len: store has 32, this run has 16); extract into another --golden-dir, or add --force-regen "
            "to replace the store (the old one is kept until the new one is complete)"
        ]
    )
    text = result.stdout.str() + result.stderr.str()
    assert text.count("this store holds goldens of another extraction") == 1
    assert "During handling" not in text


def test_extract_into_a_store_of_another_envelope_is_refused(fresh):
    """A store whose envelopes were made by other perturbed runs (another rule, another K) takes
    no goldens of this extraction: its whole-model envelope, kept where it verifies, would be
    judged beside layers' envelopes of another making."""
    fresh.runpytest("--gpu-golden", "--extract", "--layers", "0").assert_outcomes(passed=1)
    result = fresh.runpytest("--gpu-golden", "--extract", "--layers", "1", "--envelope-samples", "6")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*another extraction (envelope.runs: store has 12, this run has 6); extract into*"])
    manifest_path = fresh.path / "store" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["envelope"]  # a store made before its manifest recorded the rule
    manifest_path.write_text(json.dumps(manifest))
    result = fresh.runpytest("--gpu-golden", "--extract", "--layers", "1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*(envelope.rule: store has None, this run has {ENVELOPE_RULE}; *--force-regen*"])


def test_force_regen_replaces_the_store_and_keeps_nothing_aside(fresh):
    fresh.runpytest("--gpu-golden", "--extract", "--layers", "0").assert_outcomes(passed=1)
    result = fresh.runpytest("--gpu-golden", "--extract", "--layers", "1", "--seq-len", "16", "--force-regen")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["--force-regen: */store replaced; the previous store was removed"])
    manifest = json.loads((fresh.path / "store" / "manifest.json").read_text())
    assert manifest["inputs"]["seq_len"] == 16
    assert set(manifest["files"]) == {"layer_1", "layer_1.decode_0", "layer_1.decode_1", "model_io", "model_logits"}
    assert not (fresh.path / "store.previous").exists()


def test_force_regen_is_for_extraction_only(fresh):
    result = fresh.runpytest("--target", "cpu", "--force-regen")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --force-regen replaces a golden store by a new extraction*"])


def test_reference_reproduces_its_goldens(fresh):
    fresh.runpytest("--gpu-golden", "--extract", "--layers", "0-1").assert_outcomes(passed=2)
    result = fresh.runpytest("--gpu-golden", "--layers", "0-1", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_golden_reproducible?layer_0? PASSED*", "*layerparity summary*"])


def test_prompt_needs_a_tokenizer(fresh):
    result = fresh.runpytest("--gpu-golden", "--extract", "--layers", "0", "--prompt", "hello")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*--prompt needs the model's tokenizer, and * has none (tokenizer.json, *); drop --prompt to use seeded "
            "random token ids"
        ]
    )


def test_committed_goldens_are_reproducible():
    """The committed default goldens are what the default extraction makes here."""
    from support import DEFAULT_GOLDENS

    manifest = json.loads((DEFAULT_GOLDENS / "manifest.json").read_text())
    assert set(manifest["files"]) == {f"layer_{i}{s}" for i in range(6) for s in ("", ".decode_0", ".decode_1")} | {
        "model_io",
        "model_logits",
    }
    assert manifest["dtype"] == "bfloat16"


def test_an_encoder_has_its_prompt_goldens_and_says_why_no_decode_steps(pytester):
    """A model without an LM head (BERT's encoder, by --layer-module) has no next token to
    decode: its prompt goldens are written and the summary says why there are no decode steps;
    a model with logits that returns no cache is refused instead (tests/unit/test_support)."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    torch.manual_seed(0)
    BertModel(config).save_pretrained(pytester.path / "bert")
    pytester.makeini("[pytest]\nlayerparity_golden_dir = store\nlayerparity_layer_module = encoder.layer\n")
    result = pytester.runpytest("--gpu-golden", "--extract", f"--model={pytester.path / 'bert'}", "--seq-len", "8")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "decode steps: none: BertModel has no LM head (no logits, no next token to decode); "
            "its goldens are the prompt's"
        ]
    )
    assert not list((pytester.path / "store").glob("*.decode_*"))


# -- a reference that overflows in the dtype ------------------------------------------------------

OVERFLOW = (
    "the reference model itself overflows in float16: first at layer 1, whose output holds * inf/NaN values "
    "(largest finite magnitude *; float16 holds at most 65504). This is the HuggingFace model's own forward on the "
    "golden input, not a port; no golden was written. Measured through layer 1: bfloat16 does not overflow (largest "
    "magnitude *), float32 does not overflow (largest magnitude *). Extract in bfloat16: pytest --gpu-golden --extract "
    "--model={model} --golden-dir={store} --dtype bfloat16"
)


@pytest.fixture
def overflowing(pytester):
    """A tiny llama whose layer 1 has its MLP's input norm and output projection scaled up 64-fold:
    that layer's output passes float16's 65504 (about 7e5; bfloat16 and float32 hold it)."""
    from tiny_models import make, scale_weights

    model = make("llama", pytester.path / "llama", num_layers=3)
    return scale_weights(model, 64, "model.layers.1.post_attention_layernorm.", "model.layers.1.mlp.down_proj.")


def test_a_reference_that_overflows_is_named_once_with_the_dtypes_that_do_not(pytester, overflowing):
    store = pytester.path / "store"
    command = ["--gpu-golden", "--extract", f"--model={overflowing}", f"--golden-dir={store}"]
    result = pytester.runpytest(*command, "--dtype", "float16")
    result.assert_outcomes(failed=1)  # the first test says it; the run stops there
    result.stdout.fnmatch_lines(
        [
            OVERFLOW.format(model=overflowing, store=store),
            "FAILED layerparity::test_extract_golden[[]layer_0[]] - Failed: the reference mode*",
            "!* layerparity: the reference overflows in float16; nothing written !*",
        ]
    )
    text = result.stdout.str() + result.stderr.str()
    assert printed_before_summary(result).count("whose output holds") == 1 and "Traceback" not in text
    assert [p.name for p in store.iterdir()] == []  # no golden, no manifest, no spilled call left
    fixed = pytester.runpytest(*command, "--dtype", "bfloat16")
    fixed.assert_outcomes(passed=3)
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["dtype"] == "bfloat16" and {"layer_1", "model_logits"} <= set(manifest["files"])


def test_xdist_workers_name_the_overflow_and_stop(pytester, overflowing):
    """Each worker runs the reference of its own layers: each that does says it once."""
    store = pytester.path / "store"
    result = pytester.runpytest_subprocess(
        "--gpu-golden", "--extract", f"--model={overflowing}", f"--golden-dir={store}", "--dtype", "float16", "-n", "2"
    )
    assert result.parseoutcomes()["failed"] <= 2 and "passed" not in result.parseoutcomes()
    result.stdout.fnmatch_lines(
        [OVERFLOW.format(model=overflowing, store=store), "!* layerparity: the reference overflows in float16; *"]
    )
    assert [p.name for p in store.iterdir()] == []


@pytest.mark.parametrize(
    ("module", "where", "through"),
    [
        ("model.layers.1", "layer 1, decode step 0", "layer 1, on the prompt and its 1 decoded token(s)"),
        ("lm_head", "the logits", "the whole forward"),
    ],
)
def test_an_overflow_in_a_decode_step_or_the_logits_is_named_there(tmp_path, monkeypatch, module, where, through):
    """float16 made to overflow in one place: a layer's decode steps (one token fed; the other
    dtypes are measured teacher-forced, the prompt and the decoded token in one forward), or the
    LM head on the prompt. The error is kept: a second layer's extraction does not run it again."""
    from tiny_models import make

    from pytest_layerparity.options import make_settings
    from pytest_layerparity.reference import reference_model
    from pytest_layerparity.reference.overflow import ReferenceOverflow
    from pytest_layerparity.session import LayerParitySession

    loads = []

    def overflowing_load(model, settings, dtype, device_map):
        loaded, placement = load_whole_model(model, settings, dtype, device_map)
        loads.append(dtype)

        def inf(mod, args, output):
            decoding = output.shape[1] == 1 or module == "lm_head"
            return output.masked_fill(torch.ones_like(output, dtype=torch.bool), float("inf")) if decoding else None

        if dtype == torch.float16:
            loaded.get_submodule(module).register_forward_hook(inf)
        return loaded, placement

    load_whole_model = reference_model.load_whole_model
    monkeypatch.setattr(reference_model, "load_whole_model", overflowing_load)
    model, store = make("llama", tmp_path / "llama", num_layers=3), tmp_path / "store"
    settings = make_settings(gpu_golden=True, extract=True, model=str(model), golden_dir=str(store), dtype="float16")
    session = LayerParitySession(settings, ROOT)
    with pytest.raises(ReferenceOverflow) as raised:
        session.extract_layer(0)
    count = 64 if module != "lm_head" else 32 * 1024  # the new token's hidden states; the prompt's logits
    head, measured = str(raised.value).split(" Measured through ")
    assert head == (
        f"the reference model itself gives inf/NaN in float16: first at {where}, whose output holds {count} inf/NaN "
        "values (largest finite magnitude 0; float16 holds at most 65504). This is the HuggingFace model's own "
        "forward on the golden input, not a port; no golden was written."
    )
    assert fnmatch.fnmatch(
        measured,
        f"{through}: bfloat16 does not overflow (largest magnitude *), float32 does not overflow (largest "
        f"magnitude *). Extract in bfloat16: pytest --gpu-golden --extract --model={model} --golden-dir={store} "
        "--dtype bfloat16",
    )
    with pytest.raises(ReferenceOverflow) as again:
        session.extract_layer(1)
    assert str(again.value) == str(raised.value)
    assert loads == [torch.float16, torch.bfloat16, torch.float32]  # the reference ran once in each dtype
    assert list(store.iterdir()) == []
