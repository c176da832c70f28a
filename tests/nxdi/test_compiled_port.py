"""``--port nxdi --target neuron``: each layer of NxDI's port handed to a builder with
``build_module``'s contract, the way NxDI compiles a module (the application's compiler
arguments, tp_degree, logical_nc_config, the compiler workdir under --compile-cache, the
converted layer as the checkpoint), then called on host tensors. neuronx-cc cannot run here:
the builder is ``standin_build_module`` (a CPU stand-in of NxDI's build_module, named as
one), given through the ``pytest_layerparity_nxdi_build_module`` hook."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from make_nxdi_fixtures import checkpoint, golden_dir

HERE = Path(__file__).resolve().parent
STANDIN = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
from standin_build_module import pytest_layerparity_nxdi_build_module
"""


def run(
    pytester: pytest.Pytester,
    name: str,
    dtype: str,
    *args: str,
    builder: str = STANDIN,
    flags: tuple[str, ...] = ("--port", "nxdi", "--target", "neuron"),
    model: Path | None = None,
) -> pytest.RunResult:
    if builder:
        pytester.makeconftest(builder)
    return pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        *flags,
        f"--model={model or checkpoint(name)}",
        f"--golden-dir={golden_dir(name, dtype)}",
        *args,
    )


def builds(pytester: pytest.Pytester, swap_checks: bool = False) -> list[dict]:
    """The recorded builds: the programs (``swap_checks``: the first weight swap's fresh build)."""
    made = [json.loads(line) for line in (pytester.path / "builds.jsonl").read_text().splitlines()]
    return [b for b in made if (Path(b["compiler_workdir"]).parent.name == "swap-check") == swap_checks]


def nxd_calls(pytester: pytest.Pytester, call: str) -> list[dict]:
    """The recorded calls of ``call`` (the stand-in's ``record_nxd_calls``)."""
    lines = (pytester.path / "nxd_calls.jsonl").read_text().splitlines()
    return [c for c in map(json.loads, lines) if c["call"] == call]


def loads(pytester: pytest.Pytester) -> list[dict]:
    path = pytester.path / "loads.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def entries(cache: Path, app: str) -> list[str]:
    """The compile cache's entries of ``app``: one folder per program."""
    return sorted(p.name for p in (cache / "nxdi" / app).iterdir())


@pytest.mark.parametrize(("name", "dtype"), [("llama", "float32"), ("mixtral", "bfloat16")])
def test_compiled_port_passes_every_layer_prompt_decode_and_model(pytester, name, dtype):
    result = run(pytester, name, dtype, "--compile-cache=cc")
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(
        [
            "layerparity: port NxDI port Neuron*ForCausalLM / Neuron*DecoderLayer (*), compiled once per program "
            "(layer kind and call shape; other layers' weights loaded into it, the first swap checked against a fresh "
            "build of its layer) by standin_build_module.build_module "
            "(a conftest's pytest_layerparity_nxdi_build_module) "
            "(tp_degree 1, logical_nc_config 1 (NxDI's NeuronConfig default on trn1); compiler workdirs under "
            f"{pytester.path}/cc)*",
        ]
    )
    made = builds(pytester)
    app = "NeuronLlamaForCausalLM" if name == "llama" else "NeuronMixtralForCausalLM"
    prompt = [b for b in made if len(b["example"]) == 3]
    decode = [b for b in made if len(b["example"]) == 5]
    # both layers, both decode steps and the whole model: one context-encoding and one token-generation program
    assert len(prompt) == 1 and len(decode) == 1 and len(made) == 2
    for b in made:
        assert b["module"] == "LayerProgram" and b["init"] == ["config", "index", "layer_cls"]
        assert b["index"] == 0  # built with the first layer that called it
        assert b["tp_degree"] == 1 and b["logical_nc_config"] == b["neuron_config"]["logical_nc_config"] == 1
        folder = Path(b["compiler_workdir"]).parent  # the program's entry
        assert folder.parent == pytester.path / "cc" / "nxdi" / app
        assert b["checkpoint_path"] == str(folder / "checkpoint.pt")
        assert "--verify-hlo=true" in b["compiler_args"]
        hidden, mask, positions = b["example"][:3]
        # positions int32, as NxDI's ModelWrapper.input_generator makes them
        assert mask[1] == "torch.bool" and positions[1] == "torch.int32" and hidden[1] == f"torch.{dtype}"
    # each program's layer built from its model tag's config, as NxDI's model_base sets it
    # (enable_context_encoding / enable_token_generation), the weight-layout optimisation for token generation only
    cte, tkg = prompt[0]["neuron_config"], decode[0]["neuron_config"]
    assert (cte["is_prefill_stage"], cte["n_active_tokens"], cte["bucket_n_active_tokens"]) == (True, 34, True)
    assert (tkg["is_prefill_stage"], tkg["n_active_tokens"], tkg["bucket_n_active_tokens"]) == (False, 1, False)
    assert tkg["sequence_parallel_enabled"] is False and cte["buckets"] == tkg["buckets"] == [34]
    assert prompt[0]["priority_model_idx"] is None and decode[0]["priority_model_idx"] == 0
    # ModelWrapper's adjustment for token generation where the application has no compiler arguments of its own
    assert (cte["cc_pipeline_tiling_factor"], tkg["cc_pipeline_tiling_factor"]) == (
        (2, 1) if name == "llama" else (2, 2)
    )
    # each weight load sharded by a ModelBuilder given what the program was built with
    for add in nxd_calls(pytester, "ModelBuilder.add"):
        if add["caller"] == "compiled.py:shard":
            (built,) = [b for b in made if b["example"] == add["arguments"]["example_inputs"][0]]
            assert add["arguments"]["priority_model_idx"] == built["priority_model_idx"]
            assert add["arguments"]["compiler_args"] == built["compiler_args"]
    (step,) = decode
    past = step["example"][3][0]
    # one token, its past in a static KV cache of the goldens' prompt + decode tokens (32 + 2)
    assert step["example"][0][0][1] == 1 and past[2] == 34 and step["example"][1][0] == [1, 1, 1, 34]
    assert Path(prompt[0]["compiler_workdir"]).parent.name.startswith("context_encoding_model-")
    assert Path(step["compiler_workdir"]).parent.name.startswith("token_generation_model-")
    if name == "mixtral":  # the application's own arguments
        assert all("--enable-mixed-precision-accumulation" in b["compiler_args"] for b in made)
    else:  # NxDI's defaults per model: context encoding -O1, token generation -O2
        assert " -O1 " in prompt[0]["compiler_args"] and " -O2 " in step["compiler_args"]
    # the compile cache: one entry per program, each with its compiler workdir
    assert entries(pytester.path / "cc", app) == sorted(Path(b["compiler_workdir"]).parent.name for b in made)
    assert all((Path(b["compiler_workdir"]) / "compiler_args.txt").exists() for b in made)
    # layer 1's weights swapped in where layer 0's were held: once per pass that moves between the layers
    # (prompt test 1, decode test 1 for both of its steps, whole model: prompt 2, each decode token 2)
    assert len(loads(pytester)) == 8
    assert {x["workdir"] for x in loads(pytester)} == {b["compiler_workdir"] for b in made}


def test_six_layers_and_two_decode_steps_build_two_programs_for_all_their_tests(pytester):
    """The measured case of ``bench/bench_compile_once.py``: 13 tests (6 layers' prompt, their
    decode steps, the whole model) built 36 programs when each layer and call shape had its own."""
    result = run(pytester, "llama6", "float32", "--compile-cache=cc")
    result.assert_outcomes(passed=13)
    made = builds(pytester)
    assert sorted(len(b["example"]) for b in made) == [3, 5]  # context encoding, token generation
    assert entries(pytester.path / "cc", "NeuronLlamaForCausalLM") == sorted(
        Path(b["compiler_workdir"]).parent.name for b in made
    )
    # built with layer 0; layers 1-5 loaded in the layer tests (once each per program), then each of the
    # whole model's 3 passes loads all 6 (the program held layer 5 from the test before)
    assert len(loads(pytester)) == 5 + 5 + 3 * 6
    assert all(x["ranks"] == 1 and x["start_rank"] == 0 for x in loads(pytester))


PLANT_IN_LAYER_3 = """
from pytest_layerparity.ports.nxdi import NxdiPort

converted = NxdiPort.layer_state


def planted(self, index, config, dtype):  # the port's conversion of layer 3's down projection, wrong
    state = converted(self, index, config, dtype)
    return {k: v * 1.5 if index == 3 and k.endswith("down_proj.weight") else v for k, v in state.items()}


NxdiPort.layer_state = planted
"""


def test_a_bug_planted_in_one_layers_weights_fails_that_layer_alone(pytester):
    """Every layer runs with its own weights in the shared program: layer 3's down projection
    scaled by 1.5 as the port converts it (the checkpoint, which the goldens are bound to, is
    the same) fails layer 3's prompt and decode tests and the whole model, and nothing else
    (had layer 3 run with another layer's weights, it would pass and that layer's would fail)."""
    result = run(pytester, "llama6", "float32", "-rf", builder=STANDIN + PLANT_IN_LAYER_3)
    result.assert_outcomes(passed=10, failed=3)
    failed = sorted(line.split()[1] for line in result.stdout.lines if line.startswith("FAILED "))
    assert failed == [
        "layerparity::test_layer_decode_parity[layer_3]",
        "layerparity::test_layer_parity[layer_3]",
        "layerparity::test_model_parity",
    ]
    assert len(builds(pytester)) == 2


TWO_KINDS = """
import copy

from neuronx_distributed_inference.models.llama import modeling_llama as llama

WINDOW = 33  # covers the goldens' 32-token prompt and its past: the windowed layers compute what global ones do


class TwoKindsDecoderLayer(llama.NeuronLlamaDecoderLayer):
    pass


class TwoKindsModel(llama.NeuronLlamaModel):
    pass


class TwoKindsForCausalLM(llama.NeuronLlamaForCausalLM):
    _model_cls = TwoKindsModel


def get_updated_configs(config):
    # even layers slide, odd ones are global (as Gemma-3's get_updated_configs makes its kinds)
    configs = [copy.deepcopy(c) for c in llama.get_updated_configs(config)]
    for i, c in enumerate(configs):
        c.sliding_window = WINDOW if i % 2 == 0 else None
    return configs
"""


def test_two_layer_kinds_make_one_program_per_kind_and_call(pytester):
    """NxDI's per-layer configs (``get_updated_configs``) make two kinds of layer, windowed and
    global attention: one program per kind and model tag, each shared by its three layers."""
    pytester.makepyfile(two_kinds=TWO_KINDS)
    app = ("-o", "layerparity_nxdi_app=two_kinds:TwoKindsForCausalLM")
    result = run(pytester, "llama6", "float32", *app, "--compile-cache=cc")
    result.assert_outcomes(passed=13)
    made = builds(pytester)
    assert sorted((len(b["example"]), b["index"]) for b in made) == [(3, 0), (3, 1), (5, 0), (5, 1)]
    assert len(entries(pytester.path / "cc", "TwoKindsForCausalLM")) == 4
    # each kind's program built with its first layer and loaded with its two others, in every pass
    assert len(loads(pytester)) == 2 * 2 + 2 * 2 + 3 * 6


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("llama", torch.float32), ("mixtral", torch.bfloat16), ("mistral", torch.float32), ("qwen3_moe", torch.float32)],
)
def test_a_decode_step_in_the_static_kv_cache_computes_what_the_unpadded_one_does(name, dtype):
    """What the token-generation program relies on, in NxD's CPU mode, uncompiled: NxDI's layer
    given its past padded to the KV cache's length (garbage in the padding, masked out) returns
    the unpadded call's output and new keys and values, to float rounding (measured: float32
    within 1e-6, bfloat16 equal)."""
    from pytest_layerparity.model.source import ModelSource
    from pytest_layerparity.ports.nxdi import NxdiPort, nxd_warnings_quiet, static_kv_cache

    torch.manual_seed(0)
    port = NxdiPort(lambda: ModelSource(checkpoint(name)))
    try:
        layer = port.build(1, dtype, 1, 34).layer
        for held in (1, 16, 32, 33):
            hidden = torch.randn(1, 1, 64, dtype=dtype)
            past = tuple(torch.randn(1, 2, held, 16, dtype=dtype) for _ in range(2))
            mask = torch.ones(1, 1, 1, held, dtype=torch.bool)
            positions = torch.tensor([[held]])
            padded_mask, padded = static_kv_cache(mask, past, 34)
            assert padded_mask.shape == (1, 1, 1, 34) and not padded_mask[..., held:].any()
            for t in padded:
                t[:, :, held:] = 1e3 * torch.randn_like(t[:, :, held:])  # what is masked must not matter
            with torch.no_grad(), nxd_warnings_quiet():  # NxDI's own deprecation notices
                want = layer(hidden, attention_mask=mask, position_ids=positions, past_key_value=past)
                got = layer(hidden, attention_mask=padded_mask, position_ids=positions, past_key_value=padded)
            tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
            torch.testing.assert_close(got[0], want[0], **tol)
            for g, w in zip(got[1], want[1], strict=True):
                torch.testing.assert_close(g, w, rtol=0, atol=0)  # the new token's keys and values
    finally:
        port.stop()


def test_a_past_longer_than_the_kv_cache_is_refused():
    from pytest_layerparity.ports.nxdi import PortError, static_kv_cache

    past = (torch.zeros(1, 2, 34, 16), torch.zeros(1, 2, 34, 16))
    with pytest.raises(PortError, match="past of 34 tokens does not fit the token-generation program's KV cache of 34"):
        static_kv_cache(torch.ones(1, 1, 1, 34, dtype=torch.bool), past, 34)


def test_compiled_qwen3_moe_port_fails_on_the_unnormalised_checkpoint(pytester):
    # --neuron alone is --port nxdi --target neuron
    result = run(
        pytester,
        "qwen3_moe_unnormalized",
        "float32",
        "-k",
        "layer_parity and layer_0",
        "--op-compare",
        flags=("--neuron",),
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["layerparity: port NxDI port NeuronQwen3MoeForCausalLM *, compiled once per program*"])
    result.stdout.fnmatch_lines(
        [
            "*op compare: not available for a compiled program (its ops are inside one NEFF); compare the port's "
            "sub-blocks eagerly with: pytest --port nxdi --target cpu --op-compare*",
        ]
    )
    args = builds(pytester)[0]["compiler_args"]
    own = "--enable-saturate-infinity --enable-mixed-precision-accumulation --model-type transformer -O1"
    assert args.startswith(own)  # Qwen3-MoE's get_compiler_args for context encoding


def test_without_the_neuron_sdk_nxdis_builder_is_refused_naming_the_install(pytester):
    result = run(pytester, "llama", "float32", builder="")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--neuron: torch_neuronx* not installed; install the AWS Neuron SDK*"])


def test_a_builder_that_leaves_its_process_group_set_up_fails_the_test(pytester):
    leaky = (
        STANDIN
        + """
import torch.distributed as dist
import standin_build_module as s

def leaky(*args, **kwargs):
    program = s.build_module(*args, **kwargs)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return program

def pytest_layerparity_nxdi_build_module(settings):
    return leaky
"""
    )
    result = run(pytester, "llama", "float32", "-k", "layer_parity and layer_0", builder=leaky)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the builder left a gloo process group set up after compiling*"])


def test_logical_nc_config_reaches_the_neuron_config_and_the_compiler(pytester, monkeypatch):
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    result = run(
        pytester, "llama", "float32", "-k", "layer_parity and layer_1", "-o", "layerparity_logical_nc_config=2"
    )
    result.assert_outcomes(passed=1)
    (made,) = builds(pytester)
    assert made["logical_nc_config"] == made["neuron_config"]["logical_nc_config"] == 2
    assert "--lnc=2" in made["compiler_args"]
    # NxDI's NeuronConfig takes NEURON_LOGICAL_NC_CONFIG over the option: the two disagreeing is refused up front
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    both = run(pytester, "llama", "float32", "-o", "layerparity_logical_nc_config=2")
    assert both.ret == pytest.ExitCode.USAGE_ERROR
    both.stderr.fnmatch_lines(
        [
            "*NEURON_LOGICAL_NC_CONFIG=1 and -o layerparity_logical_nc_config=2 disagree; NxDI's NeuronConfig takes "
            "the variable: unset it, or drop the option*"
        ]
    )


@pytest.mark.parametrize(
    ("option", "lnc", "origin"),
    [
        ((), 2, "NxDI's NeuronConfig default on trn2"),
        (("-o", "layerparity_logical_nc_config=1"), 1, "layerparity_logical_nc_config"),
    ],
)
def test_on_trn2_every_program_is_built_sharded_and_laid_out_for_one_lnc(pytester, monkeypatch, option, lnc, origin):
    """On a Trn2 platform (the stand-in's ``get_platform_target`` reads NEURON_PLATFORM_TARGET_OVERRIDE
    first, as torch-neuronx's does) NxDI's NeuronConfig takes LNC 2 unless told otherwise
    (models/config.py, _get_lnc). That one value reaches the layer's NeuronConfig and compiler
    arguments, ``build_module`` (ModelBuilder's parallel_state and weight-layout program), the
    ModelBuilder that shards each weight load, and every parallel_state set up to build a layer:
    the plugin's traced world, ModelBuilder's own, the builder's. The option overrides it
    everywhere at once."""
    import inspect

    from neuronx_distributed.parallel_layers.parallel_state import initialize_model_parallel
    from neuronx_distributed.trace.model_builder import ModelBuilder
    from neuronx_distributed_inference.utils.testing import build_module

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    result = run(pytester, "llama", "float32", "-k", "layer_parity or layer_decode_parity", *option)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines([f"layerparity: port NxDI port *(tp_degree 1, logical_nc_config {lnc} ({origin});*"])
    made = builds(pytester)
    assert sorted(len(b["example"]) for b in made) == [3, 5]
    for b in made:
        assert b["logical_nc_config"] == b["neuron_config"]["logical_nc_config"] == lnc
        assert f"--lnc={lnc}" in b["compiler_args"] and b["replica_logic"] == "LOGIC1"
    inits = nxd_calls(pytester, "initialize_model_parallel")
    callers = {c["caller"] for c in inits}
    assert {
        "compiled.py:traced_world",
        "model_builder.py:shard_checkpoint",
        "standin_build_module.py:_traced_parallel_state",
    } <= callers
    assert {c["arguments"].get("lnc_size") for c in inits} == {lnc}
    builders = nxd_calls(pytester, "ModelBuilder")
    assert builders and all(c["caller"] == "compiled.py:shard" for c in builders)  # one per weight load
    assert {c["arguments"]["logical_nc_config"] for c in builders} == {lnc}
    # every call the plugin made binds to the real function's signature (NxD's and NxDI's sources)
    real = {
        "build_module": inspect.signature(build_module),
        "ModelBuilder": inspect.signature(ModelBuilder.__init__),
        "ModelBuilder.add": inspect.signature(ModelBuilder.add),
        "initialize_model_parallel": inspect.signature(initialize_model_parallel),
    }
    for name, signature in real.items():
        calls = [
            c for c in nxd_calls(pytester, name) if name == "build_module" or c["caller"].startswith("compiled.py")
        ]
        assert calls, name
        for c in calls:  # a method's positional count includes self
            signature.bind(*range(c["positional"]), **dict.fromkeys(c["keywords"]))


def test_the_standin_refuses_two_core_layouts_for_one_program(tmp_path):
    """What a build with two logical NeuronCore configs would compile on Trainium: a program and
    ModelBuilder's parallel_state and weight-layout program for different core layouts."""
    from types import SimpleNamespace

    from standin_build_module import build_module

    class Layer(torch.nn.Module):
        def __init__(self, config: object = None) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(2, 2, bias=False)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
            return (self.proj(x),)

    example = [(torch.zeros(1, 2),)]
    with pytest.raises(ValueError, match="--lnc=2 and build_module was given logical_nc_config=1"):
        build_module(Layer, example, compiler_args="-O1 --lnc=2", compiler_workdir=str(tmp_path))
    on_lnc2 = {"config": SimpleNamespace(neuron_config=SimpleNamespace(logical_nc_config=2))}
    with pytest.raises(ValueError, match=r"NeuronConfig has logical_nc_config 2 and build_module was given .*=1"):
        build_module(Layer, example, on_lnc2, compiler_args="-O1", compiler_workdir=str(tmp_path))


def test_expert_parallelism_reaches_the_neuron_config_and_is_refused_on_the_cpu(pytester):
    """layerparity_ep_degree is NxDI's moe_ep_degree of the compiled programs (the experts' tensor
    parallelism the rest of --tp-degree, the builder's world the tp ranks); NxD's CPU mode has
    no expert parallelism, so there it is refused rather than run as plain tensor parallelism."""
    from types import SimpleNamespace

    from pytest_layerparity.ports.compiled import CompiledPrograms
    from pytest_layerparity.ports.nxdi import NxdiPort, nxd_warnings_quiet

    source = SimpleNamespace(config_json=json.loads((checkpoint("mixtral") / "config.json").read_text()))
    port = NxdiPort(lambda: source, None, CompiledPrograms(tp_degree=4, ep_degree=2))
    with nxd_warnings_quiet():  # NxDI's own deprecation notices, as in a session
        neuron = port.inference_config(torch.float32, 1, 32).neuron_config
    assert (neuron.tp_degree, neuron.moe_ep_degree, neuron.moe_tp_degree) == (4, 2, 2)
    with nxd_warnings_quiet():
        described = port.describe()
    assert "(tp_degree 4, moe_ep_degree 2, logical_nc_config 1 (NxDI's NeuronConfig default on trn1);" in described

    ep2 = ("-o", "layerparity_ep_degree=2")
    cpu = run(pytester, "mixtral", "float32", *ep2, flags=("--port", "nxdi", "--target", "cpu"))
    assert cpu.ret == pytest.ExitCode.USAGE_ERROR
    cpu.stderr.fnmatch_lines(
        [
            "*-o layerparity_ep_degree=2 shards the experts of NxDI's MoE programs compiled under --port nxdi --target "
            "neuron (NxD's CPU mode has no expert parallelism*'_mesh'*; this run (--target cpu --port nxdi) does not "
            "use it: drop -o layerparity_ep_degree=2"
        ]
    )
    odd = run(pytester, "mixtral", "float32", "--tp-degree", "4", "-o", "layerparity_ep_degree=3")
    assert odd.ret == pytest.ExitCode.USAGE_ERROR
    odd.stderr.fnmatch_lines(["*layerparity_ep_degree = 3 must divide --tp-degree 4*"])

    compiled = run(pytester, "mixtral", "float32", "-k", "layer_parity and layer_0")
    compiled.assert_outcomes(passed=1)
    (made,) = builds(pytester)
    assert (made["world_size"], made["local_ranks_size"]) == (1, 1)


def test_a_layer_that_keeps_its_index_gets_a_program_of_its_own():
    """NxDI's Gemma-3 layer keeps its index (layer 0 scales its input, ``modeling_gemma3.py``):
    no two of its layers share a program, though layers 1-4 slide alike (``get_updated_configs``:
    every sixth layer is global)."""
    from types import SimpleNamespace

    from pytest_layerparity.ports.compiled import CompiledLayer, CompiledPrograms
    from pytest_layerparity.ports.nxdi import NxdiPort, decoder_layer_class, layer_config, nxd_warnings_quiet

    fields = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
    text = {"model_type": "gemma3_text", "num_hidden_layers": 6, "head_dim": 16, "vocab_size": 256, **fields}
    text.update(sliding_window=16, max_position_embeddings=512, query_pre_attn_scalar=16)
    spec = "neuronx_distributed_inference.models.gemma3.modeling_gemma3:NeuronGemma3ForCausalLM"
    port = NxdiPort(lambda: SimpleNamespace(config_json=text), spec, CompiledPrograms())
    layer_cls = decoder_layer_class(port.app)
    with nxd_warnings_quiet():
        config = port.inference_config(torch.float32, 1, 34)
        configs = [layer_config(layer_cls, config, i) for i in range(6)]
        layers = [CompiledLayer(port.app, layer_cls, config, i, dict) for i in range(6)]
        structures = [layer.structure("token_generation_model", 1) for layer in layers]
    assert [c.sliding_window for c in configs] == [16, 16, 16, 16, 16, None]
    assert len(set(structures)) == 6


def test_the_standin_loads_weights_strictly(tmp_path, monkeypatch):
    """The stand-in's ``nxd_model.initialize`` (NxD's weight API of a built model): one state
    dict per rank, every name the program has and no other, each of its shape."""
    from standin_build_module import StandinProgram

    monkeypatch.chdir(tmp_path)  # where it records its loads

    class Program(torch.nn.Module):  # a program's module: tensors in, a tuple of tensors out
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(2, 2, bias=False)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
            return (self.proj(x),)

    program = StandinProgram(Program(), (torch.zeros(1, 2),), 1, "w")
    start = torch.tensor([0], dtype=torch.int32)
    program.nxd_model.initialize([{"proj.weight": 2 * torch.eye(2)}], start)
    assert torch.equal(program(torch.tensor([[1.0, 2.0]]))[0], torch.tensor([[2.0, 4.0]]))
    with pytest.raises(RuntimeError, match=r"missing \['proj.weight'\], unexpected \['proj.bias'\]"):
        program.nxd_model.initialize([{"proj.bias": torch.zeros(2)}], start)
    with pytest.raises(RuntimeError, match="size mismatch"):
        program.nxd_model.initialize([{"proj.weight": torch.eye(3)}], start)
    with pytest.raises(ValueError, match="2 state dicts for 1 ranks"):
        program.nxd_model.initialize([{"proj.weight": torch.eye(2)}] * 2, start)
    assert not hasattr(program.nxd_model, "replace_weights")  # ModelBuilderV2's API, not build_module's model's
    assert len((tmp_path / "loads.jsonl").read_text().splitlines()) == 1  # the one that loaded


REPLACING = STANDIN.replace(
    "from standin_build_module import pytest_layerparity_nxdi_build_module",
    """from standin_build_module import build_module, replacing_weights


def pytest_layerparity_nxdi_build_module(settings):
    return replacing_weights(build_module)
""",
)

SWAP_IGNORED = STANDIN.replace(
    "from standin_build_module import pytest_layerparity_nxdi_build_module",
    """from standin_build_module import build_module


def ignoring_swaps(*args, **kwargs):  # a model that keeps the weights it was built with
    program = build_module(*args, **kwargs)
    program.nxd_model.initialize = lambda checkpoint, start_rank_tensor: None
    return program


def pytest_layerparity_nxdi_build_module(settings):
    return ignoring_swaps
""",
)


@pytest.mark.parametrize(("builder", "method"), [(STANDIN, "initialize"), (REPLACING, "replace_weights")])
def test_the_first_weight_swap_is_checked_once_against_a_fresh_build(pytester, builder, method):
    """Weights go into a built program by the NxD model's ``replace_weights`` where it has one
    (ModelBuilderV2's), else ``initialize``; the session's first swap is run beside a fresh
    build of the same layer on the same call, once, and the summary says what it found."""
    result = run(pytester, "llama", "float32", builder=builder)
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(
        [
            "layerparity: the first weight swap (layer 1 into program context_encoding_model-*, by "
            f"nxd_model.{method}) computes what a fresh build with layer 1's weights computes, bit for bit"
        ]
    )
    (check,) = builds(pytester, swap_checks=True)
    assert check["index"] == 1 and len(check["example"]) == 3  # layer 1's prompt, where the first swap was
    assert len(builds(pytester)) == 2
    assert {x["method"] for x in loads(pytester)} == {method} and len(loads(pytester)) == 8


def test_a_weight_swap_that_does_not_take_fails_naming_the_sdk(pytester):
    """A model that keeps its build's weights when given another layer's (the behaviour the
    check is for: closed source, verified where it runs): the first swap's check fails the test
    that swapped, naming the method, and every later test that would swap fails with its
    message, checked once; layer 0's tests pass."""
    result = run(
        pytester, "llama", "float32", "-k", "test_layer_decode_parity or test_layer_parity", builder=SWAP_IGNORED
    )
    result.assert_outcomes(passed=2, failed=2)  # layer 0's prompt and decode; layer 1's both, checked once
    assert len(builds(pytester, swap_checks=True)) == 1
    result.stdout.fnmatch_lines(
        ["*WeightSwapMismatch: layer 1's weights *(the session's first swap; no later swap is made)"]
    )
    result.stdout.fnmatch_lines(
        [
            "*WeightSwapMismatch: layer 1's weights swapped into program context_encoding_model-* (built with layer "
            "0's) do not compute what a fresh build with layer 1's weights computes on the same call (largest "
            "difference *): the SDK's weight loading into a built program (nxd_model.initialize) does not give it the "
            "weights a build does*",
        ]
    )
