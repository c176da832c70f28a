"""``--port nxdi --target cpu``: NxDI's own decoder layers (Llama, Mixtral, Qwen3-MoE, Qwen2,
Qwen3, Mistral), built the way NxDI builds them and run in NxD's CPU mode, against goldens
extracted with transformers 5, prompt and decode steps and the whole model, in float32 and
bfloat16."""

from __future__ import annotations

import pytest
from make_nxdi_fixtures import checkpoint, golden_dir


def run(pytester: pytest.Pytester, name: str, dtype: str, *args: str, subprocess: bool = False) -> pytest.RunResult:
    runner = pytester.runpytest_subprocess if subprocess else pytester.runpytest
    return runner(
        "-p",
        "no:cacheprovider",
        "--port",
        "nxdi",
        "--target",
        "cpu",
        f"--model={checkpoint(name)}",
        f"--golden-dir={golden_dir(name, dtype)}",
        *args,
    )


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        *((name, dtype) for name in ("llama", "mixtral", "qwen3_moe") for dtype in ("float32", "bfloat16")),
        ("qwen2", "float32"),
        ("qwen3", "bfloat16"),
        ("mistral", "float32"),  # sliding window 16 under a 32-token prompt
    ],
)
def test_correct_nxdi_port_passes_every_layer_prompt_decode_and_model(pytester, name, dtype):
    result = run(pytester, name, dtype)
    result.assert_outcomes(passed=5)  # 2 layers' prompt, their decode steps, the whole model
    result.stdout.fnmatch_lines(
        [
            "layerparity: port NxDI port Neuron*ForCausalLM / Neuron*DecoderLayer (neuronx-distributed-inference *), "
            "NxD CPU mode (gloo, world size 1), no Neuron compile; stand-ins for the closed-source torch_neuronx*",
        ]
    )


def test_in_order_of_position_undoes_nxdi_sliding_window_ring_layout():
    """NxDI's prompt returns a sliding window's last W keys with position p in slot p mod W
    (its get_last_kv_window); the port's adapter puts them back in the positions' order."""
    import torch
    from neuronx_distributed_inference.modules.attention.utils import get_last_kv_window

    from pytest_layerparity.ports.nxdi import in_order_of_position

    for seq in (17, 32, 45):
        keys = torch.arange(seq, dtype=torch.float32).view(1, 1, seq, 1).expand(2, 3, seq, 4)
        position_ids = torch.arange(seq).expand(2, seq)
        ring = get_last_kv_window(16, position_ids, keys, keys + 0.5)
        assert not torch.equal(ring[0], keys[:, :, -15:]) or seq % 15 == 0
        ordered = in_order_of_position(ring, position_ids)
        assert torch.equal(ordered[0], keys[:, :, -15:]) and torch.equal(ordered[1], keys[:, :, -15:] + 0.5)


def test_sliding_window_port_prompt_keys_and_values_are_judged(pytester):
    """Mistral's window (16) is shorter than the prompt (32): the keys and values the NxDI
    port's prompt writes are judged against the golden's and pass."""
    import xml.etree.ElementTree as ET

    result = run(pytester, "mistral", "float32", "--junitxml=out.xml")
    result.assert_outcomes(passed=5)
    judged = {}
    for case in ET.parse(pytester.path / "out.xml").getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if case.get("name", "").startswith("test_layer_parity"):
            judged[case.get("name")] = (props.get("prompt_kv"), float(props.get("prompt_keys_cosine", "nan")))
    assert len(judged) == 2 and all(kv == "judged" and cosine > 0.9999 for kv, cosine in judged.values()), judged


def test_qwen3_moe_port_ignores_norm_topk_prob_and_the_failure_says_routing_agreed(pytester):
    """NxDI's Qwen3-MoE normalises the top-k affinities always (normalize_top_k_affinities =
    True); a checkpoint with norm_topk_prob: false is computed otherwise by transformers.
    Every test fails, and the text shows the routing agreed on every token."""
    result = run(pytester, "qwen3_moe_unnormalized", "float32")
    result.assert_outcomes(failed=5)
    result.stdout.fnmatch_lines(["  routing (mlp.gate): all 32 tokens chose the same experts"])
    result.stdout.fnmatch_lines(["*--port nxdi*-k layer_0*"])  # the next-step command keeps the port


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_op_compare_narrows_the_qwen3_moe_failure_to_the_expert_combination(pytester, dtype):
    result = run(pytester, "qwen3_moe_unnormalized", dtype, "-k", "layer_parity and layer_0", "--op-compare")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "  block compare (each of the port's sub-blocks against the model's own, fed the port's input):",
            "    self_attn: not compared (its call differs: *",
            "    input_layernorm: same (relative error *",
            "    post_attention_layernorm: same (relative error *",
            "    mlp: DIFFERS (relative error *; every token's output points the same way (cosine >= *) but is scaled "
            "by * to *: the weights combining its parts differ (for experts: the routing weights' normalisation or "
            "scale), not the parts",
        ]
    )


def test_application_class_named_for_one_run(pytester):
    spec = "neuronx_distributed_inference.models.llama.modeling_llama:NeuronLlamaForCausalLM"
    result = run(pytester, "llama", "float32", "-o", f"layerparity_nxdi_app={spec}", "-k", "layer_parity and layer_1")
    result.assert_outcomes(passed=1)
    nope = "neuronx_distributed_inference.models.llama.modeling_llama:Nope"
    bad = run(pytester, "llama", "float32", "-o", f"layerparity_nxdi_app={nope}")
    bad.stderr.fnmatch_lines(
        ["*layerparity_nxdi_app = *: neuronx_distributed_inference.models.llama.modeling_llama has no Nope*"]
    )
    assert bad.ret != 0


def test_an_application_without_one_decoder_layer_class_is_a_usage_error(pytester):
    """DBRX's layer is a ``*Block``, Llama 4's model picks between two ``*DecoderLayer``
    classes: refused before the session, naming what was found."""
    spec = "neuronx_distributed_inference.models.dbrx.modeling_dbrx:NeuronDbrxForCausalLM"
    result = run(pytester, "llama", "float32", "-o", f"layerparity_nxdi_app={spec}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*NeuronDbrxForCausalLM: expected one *DecoderLayer class in *modeling_dbrx, found none*"]
    )


def test_cpu_mode_is_set_up_once_and_undone(pytester):
    """The process group and parallel_state exist during the session and are gone after it
    (the next session, in this same process, sets them up again)."""
    import torch.distributed as dist
    from neuronx_distributed.parallel_layers import parallel_state

    pytester.makeconftest(
        """
        import torch.distributed as dist
        from neuronx_distributed.parallel_layers import parallel_state

        def pytest_sessionfinish(session):
            ps = parallel_state
            print("during: group", dist.is_initialized(), "parallel_state", ps.model_parallel_is_initialized(),
                  "tp", ps.get_tensor_model_parallel_size(), "rank", ps.get_tensor_model_parallel_rank())
        """
    )
    result = run(pytester, "llama", "float32", "-s", "-k", "layer_parity and layer_0")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*during: group True parallel_state True tp 1 rank 0"])
    assert not dist.is_initialized()
    assert not parallel_state.model_parallel_is_initialized()
    again = run(pytester, "mixtral", "bfloat16", "-k", "layer_parity and layer_0")
    again.assert_outcomes(passed=1)


def test_layers_spread_over_xdist_workers_each_in_its_own_world_of_one(pytester):
    """Each worker sets up its own CPU mode; the controller builds nothing (no port collision)."""
    result = run(pytester, "llama", "bfloat16", "-n", "2", "--junitxml=out.xml", subprocess=True)
    result.assert_outcomes(passed=5)
    assert (pytester.path / "out.xml").read_text().count('name="noise_ratio"') == 4


def test_a_process_group_set_up_by_the_user_is_used_and_kept(pytester, monkeypatch):
    import torch.distributed as dist
    from neuronx_distributed.parallel_layers import parallel_state

    from pytest_layerparity.backends.neuron import apply_env_defaults, restore_env

    applied = apply_env_defaults()
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1, skip_collective_init=True)
    try:
        result = run(pytester, "llama", "float32", "-k", "layer_parity and layer_0")
        result.assert_outcomes(passed=1)
        assert dist.is_initialized()
        assert parallel_state.model_parallel_is_initialized()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        restore_env(applied)


@pytest.mark.parametrize("model_type", ["gpt_oss", "dbrx", "llama4_text", "deepseek_v3"])
def test_release_decoders_that_cannot_run_on_the_cpu_are_refused_by_model_type_naming_why(model_type):
    from pytest_layerparity.ports.nxdi import NOT_RUNNABLE, PortError, import_application

    with pytest.raises(PortError) as info:
        import_application(model_type)
    assert NOT_RUNNABLE[model_type] in str(info.value) and "-o layerparity_nxdi_app=" in str(info.value)
