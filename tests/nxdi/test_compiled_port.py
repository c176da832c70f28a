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
) -> pytest.RunResult:
    if builder:
        pytester.makeconftest(builder)
    return pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        *flags,
        f"--model={checkpoint(name)}",
        f"--golden-dir={golden_dir(name, dtype)}",
        *args,
    )


def builds(pytester: pytest.Pytester) -> list[dict]:
    return [json.loads(line) for line in (pytester.path / "builds.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("name", "dtype"), [("llama", "float32"), ("mixtral", "bfloat16")])
def test_compiled_port_passes_every_layer_prompt_decode_and_model(pytester, name, dtype):
    result = run(pytester, name, dtype, "--compile-cache=cc")
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(
        [
            "layerparity: port NxDI port Neuron*ForCausalLM / Neuron*DecoderLayer (*), compiled per layer and call "
            "shape by standin_build_module.build_module (a conftest's pytest_layerparity_nxdi_build_module) "
            f"(tp_degree 1, logical_nc_config NxDI's default; compiler workdirs under {pytester.path}/cc)*",
        ]
    )
    made = builds(pytester)
    app = "NeuronLlamaForCausalLM" if name == "llama" else "NeuronMixtralForCausalLM"
    prompt = [b for b in made if len(b["example"]) == 3]
    decode = [b for b in made if len(b["example"]) == 5]
    assert prompt and decode
    for b in made:
        assert b["module"] == "LayerProgram" and b["init"] == ["config", "index", "layer_cls"]
        assert b["tp_degree"] == 1 and b["logical_nc_config"] == 1  # NxDI's default, not passed
        folder = pytester.path / "cc" / "nxdi" / app / f"layer_{b['index']}"
        assert Path(b["compiler_workdir"]).parent == folder and b["checkpoint_path"] == str(folder / "checkpoint.pt")
        assert "--verify-hlo=true" in b["compiler_args"]
        hidden, mask, positions = b["example"][:3]
        assert mask[1] == "torch.bool" and positions[1] == "torch.int64" and hidden[1] == f"torch.{dtype}"
    for b in decode:
        assert b["example"][0][0][1] == 1 and b["example"][1][0][2:] == [1, b["example"][3][0][2]]  # one token; past
    if name == "mixtral":  # the application's own arguments
        assert all("--enable-mixed-precision-accumulation" in b["compiler_args"] for b in made)
    else:  # NxDI's defaults per model: context encoding -O1, token generation -O2
        assert all(" -O1 " in b["compiler_args"] for b in prompt) and all(" -O2 " in b["compiler_args"] for b in decode)
    # each program once per layer and shape in a process; the compiler workdirs are kept under --compile-cache
    assert all((Path(b["compiler_workdir"]) / "compiler_args.txt").exists() for b in made)


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
    result.stdout.fnmatch_lines(["layerparity: port NxDI port NeuronQwen3MoeForCausalLM *, compiled per layer*"])
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


def test_logical_nc_config_reaches_the_neuron_config_and_the_compiler(pytester):
    result = run(pytester, "llama", "float32", "-k", "layer_parity and layer_1", "--logical-nc-config", "2")
    result.assert_outcomes(passed=1)
    (made,) = builds(pytester)
    assert made["logical_nc_config"] == 2 and "--lnc=2" in made["compiler_args"]


def test_expert_parallelism_reaches_the_neuron_config_and_is_refused_on_the_cpu(pytester):
    """--ep-degree is NxDI's moe_ep_degree of the compiled programs (the experts' tensor
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
    assert "moe_ep_degree 2" in port.compiled.describe()

    cpu = run(pytester, "mixtral", "float32", "--ep-degree", "2", flags=("--port", "nxdi", "--target", "cpu"))
    assert cpu.ret == pytest.ExitCode.USAGE_ERROR
    cpu.stderr.fnmatch_lines(["*--ep-degree 2: NxD's CPU mode has no expert parallelism*'_mesh'*"])
    odd = run(pytester, "mixtral", "float32", "--tp-degree", "4", "--ep-degree", "3")
    assert odd.ret == pytest.ExitCode.USAGE_ERROR
    odd.stderr.fnmatch_lines(["*--ep-degree 3 must divide --tp-degree 4*"])

    compiled = run(pytester, "mixtral", "float32", "-k", "layer_parity and layer_0")
    compiled.assert_outcomes(passed=1)
    (made,) = builds(pytester)
    assert (made["world_size"], made["local_ranks_size"]) == (1, 1)
