"""`--neuron`: the session-wide distributed environment, the compile cache, the missing SDK.

What runs for real here: torch.distributed's "xla" process group on the torch-xla CPU device
(init_process_group / destroy_process_group, the env:// rendezvous on RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), the environment handling, the layers on the XLA device, torch-xla's
persistent cache. What runs against a stand-in: neuronx-distributed's parallel_state, as
``RecordingParallelState`` (tests/standin_neuron_sdk.py), because the Neuron SDK cannot be
installed here (AWS's own index; the PyPI packages of those names are empty placeholders).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
from standin_neuron_sdk import install_in_sys_modules, write_standin_sdk
from support import DEFAULT_MODEL, ROOT

from pytest_layerparity.backends import BackendUnavailable, check_installed
from pytest_layerparity.backends.neuron import (
    NeuronBackend,
    apply_env_defaults,
    configure_compile_cache,
    import_parallel_state,
    restore_env,
)

DIST_VARS = (
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "PYTEST_XDIST_WORKER",
    "TORCHELASTIC_RUN_ID",
    "NEURON_COMPILE_CACHE_URL",
    "NEURON_CC_FLAGS",
)


@pytest.fixture
def clean_env(monkeypatch):
    for name in (*DIST_VARS, "NEURON_LOGICAL_NC_CONFIG", "NEURON_PLATFORM_TARGET_OVERRIDE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def no_process_group():
    import torch.distributed as dist

    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _store_port() -> int:
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store.port


# -- environment --------------------------------------------------------------------------


def test_env_defaults_fill_only_what_is_unset():
    env: dict[str, str] = {}
    applied = apply_env_defaults(env)
    assert env == applied
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == ("0", "1", "localhost")
    assert 0 < int(env["MASTER_PORT"]) < 65536
    restore_env(applied, env)
    assert env == {}


def test_torchruns_env_is_respected():
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"}
    env = dict(torchrun)
    assert apply_env_defaults(env) == {}
    assert env == torchrun


def test_restore_keeps_what_changed_since():
    env: dict[str, str] = {}
    applied = apply_env_defaults(env, port=12355)
    env["RANK"] = "1"
    restore_env(applied, env)
    assert env == {"RANK": "1"}


def test_compile_cache_sets_neurons_cache_url(tmp_path):
    env: dict[str, str] = {}
    folder = str(tmp_path / "neuron-cache")
    assert configure_compile_cache(folder, env) == {"NEURON_COMPILE_CACHE_URL": folder}
    assert Path(folder).is_dir()
    assert configure_compile_cache("s3://bucket/cache", {}) == {"NEURON_COMPILE_CACHE_URL": "s3://bucket/cache"}
    assert configure_compile_cache(folder, {"NEURON_CC_FLAGS": f"-O1 --cache_dir={folder}"}) == {
        "NEURON_COMPILE_CACHE_URL": folder
    }


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"NEURON_CC_FLAGS": "-O1 --cache_dir=/other"},
            "NEURON_CC_FLAGS sets --cache_dir=/other, which takes precedence over NEURON_COMPILE_CACHE_URL; drop one "
            "of them",
        ),
        ({"NEURON_COMPILE_CACHE_URL": "/other"}, "NEURON_COMPILE_CACHE_URL is already /other; drop one of them"),
    ],
)
def test_compile_cache_refuses_a_conflicting_setting(tmp_path, env, message):
    with pytest.raises(BackendUnavailable, match=message):
        configure_compile_cache(str(tmp_path), dict(env))


# -- the process group (real, on the torch-xla CPU device) and parallel_state (stand-in) --


@pytest.mark.parametrize(
    ("platform", "env", "option", "lnc", "origin"),
    [
        ("trn2", None, None, 2, "NxDI's NeuronConfig default on trn2"),
        ("trn1", None, None, 1, "NxDI's NeuronConfig default on trn1"),
        ("trn2", None, 1, 1, "layerparity_logical_nc_config"),
        ("trn2", "1", None, 1, "NEURON_LOGICAL_NC_CONFIG"),
    ],
)
def test_parallel_state_gets_the_logical_nc_config_nxdi_would(
    clean_env, no_process_group, platform, env, option, lnc, origin
):
    """--neuron's parallel_state is set up with NxDI's logical NeuronCore config (its
    tensor-parallel groups are laid over a Trn2 node's cores by it): the variable, else the
    option, else the platform's (2 on trn2)."""
    state = install_in_sys_modules(clean_env)
    clean_env.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", platform)
    if env is not None:
        clean_env.setenv("NEURON_LOGICAL_NC_CONFIG", env)
    backend = NeuronBackend(tp_degree=1, logical_nc_config=option)
    backend.setup()
    try:
        assert state.CALLS[0]["lnc_size"] == lnc
        assert f"with logical NeuronCore config {lnc} ({origin})" in backend.describe()
    finally:
        backend.teardown()


def test_a_logical_nc_config_the_variable_contradicts_is_refused(clean_env, no_process_group):
    state = install_in_sys_modules(clean_env)
    clean_env.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    with pytest.raises(BackendUnavailable, match="NEURON_LOGICAL_NC_CONFIG=2 and -o layerparity_logical_nc_config=1"):
        NeuronBackend(tp_degree=1, logical_nc_config=1).setup()
    assert [c["call"] for c in state.CALLS] == []


def test_setup_initialises_once_per_process_and_teardown_undoes_it(clean_env, no_process_group):
    """RecordingParallelState stands in for neuronx-distributed's parallel_state (no Neuron SDK
    here); the "xla" process group is real."""
    import torch.distributed as dist

    state = install_in_sys_modules(clean_env)
    backend = NeuronBackend(tp_degree=1)
    backend.setup()
    assert dist.is_initialized() and dist.get_backend() == "xla" and dist.get_world_size() == 1
    assert str(backend.device).startswith("xla")
    assert _store_port() == int(os.environ["MASTER_PORT"])
    assert [c["call"] for c in state.CALLS] == ["initialize_model_parallel"]
    call = state.CALLS[0]
    assert call["tensor_model_parallel_size"] == 1 and call["pg_backend"] == "xla" and call["pg_world_size"] == 1
    # NxD's own collective set-up ran (an all-reduce over the world, on the real "xla" group), for LNC 1 on trn1
    assert call["skip_collective_init"] is False and call["collectives_initialised"] is True
    assert call["lnc_size"] == 1 and call["replica_logic"] == "LOGIC1"
    assert call["env"]["RANK"] == "0" and call["env"]["WORLD_SIZE"] == "1"

    backend.setup()  # idempotent
    second = NeuronBackend(tp_degree=1)  # another session in the same process
    second.setup()
    assert [c["call"] for c in state.CALLS] == ["initialize_model_parallel"]
    assert "already set up" in second.describe() and "set up here" in backend.describe()
    second.teardown()  # it set up nothing, so it tears down nothing
    assert dist.is_initialized() and state.model_parallel_is_initialized()

    backend.teardown()
    assert [c["call"] for c in state.CALLS] == ["initialize_model_parallel", "destroy_model_parallel"]
    assert not dist.is_initialized()
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        assert name not in os.environ


def test_a_failed_setup_leaves_nothing_behind(clean_env, no_process_group):
    """RecordingParallelState stand-in, made to fail; real process group."""
    import torch.distributed as dist

    state = install_in_sys_modules(clean_env)

    def refuse(**kwargs):
        raise RuntimeError("invalid implied data parallel degree")

    clean_env.setattr(state, "initialize_model_parallel", refuse)
    backend = NeuronBackend(tp_degree=1)
    with pytest.raises(RuntimeError, match="invalid implied data parallel degree"):
        backend.setup()
    assert not dist.is_initialized()
    assert not any(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def test_what_someone_else_initialised_is_used_and_left_alone(clean_env, no_process_group):
    """RecordingParallelState stand-in (no Neuron SDK here); real "xla" process group."""
    import torch.distributed as dist
    import torch_xla.distributed.xla_backend  # noqa: F401

    state = install_in_sys_modules(clean_env)
    apply_env_defaults()
    dist.init_process_group("xla")
    with warnings.catch_warnings():  # the collective set-up calls torch-xla's deprecated mark_step, as NxD's does
        warnings.simplefilter("ignore", DeprecationWarning)
        state.initialize_model_parallel(tensor_model_parallel_size=1)
    backend = NeuronBackend(tp_degree=1)
    backend.setup()
    backend.teardown()
    assert dist.is_initialized() and state.model_parallel_is_initialized()
    assert [c["call"] for c in state.CALLS] == ["initialize_model_parallel"]
    state.destroy_model_parallel()


def test_torchrun_variables_drive_the_rendezvous(clean_env, no_process_group):
    """The rendezvous uses the launcher's MASTER_PORT, not a default (RecordingParallelState
    stand-in for parallel_state; real process group)."""
    from pytest_layerparity.distributed.env import free_port

    port = free_port()
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        clean_env.setenv(name, value)
    install_in_sys_modules(clean_env)
    backend = NeuronBackend()
    backend.setup()
    try:
        assert _store_port() == port
    finally:
        backend.teardown()
    assert os.environ["MASTER_PORT"] == str(port)


# -- the missing SDK ----------------------------------------------------------------------


def test_missing_sdk_names_the_modules_and_the_install():
    with pytest.raises(BackendUnavailable) as info:
        check_installed("neuron")
    message = str(info.value)
    assert message.startswith("torch_neuronx, neuronx_distributed not installed; ")
    assert "pip install --extra-index-url https://pip.repos.neuron.amazonaws.com" in message
    assert "not from PyPI" in message


def test_empty_placeholder_package_is_named(monkeypatch):
    """A package that imports but holds nothing (what the PyPI placeholders install)."""
    import types

    monkeypatch.setitem(__import__("sys").modules, "neuronx_distributed", types.ModuleType("neuronx_distributed"))
    with pytest.raises(
        BackendUnavailable,
        match=r"parallel_state does not import .*; if the PyPI placeholder of that name is what is installed, pip "
        r"uninstall it, then install the AWS Neuron SDK from AWS's repository",
    ):
        import_parallel_state()


def test_neuron_sdk_missing_is_a_usage_error_with_the_install_hint(project):
    result = project.runpytest("--neuron")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*--neuron: torch_neuronx, neuronx_distributed not installed; install the AWS Neuron SDK from AWS's "
            "repository, not from PyPI*pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "
            "torch-neuronx neuronx-cc neuronx-distributed neuronx-distributed-inference*"
        ]
    )


def test_tp_degree_beyond_the_world_size_names_the_torchrun_command(project):
    result = project.runpytest("--neuron", "--port", "hf", "--tp-degree", "4")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*--neuron: --tp-degree 4 needs 4 processes, one per NeuronCore, and this run has WORLD_SIZE=1 "
            "(neuronx-distributed would quietly use tensor_model_parallel_size=1); launch the ranks with: torchrun "
            "--nproc_per_node=4 -m pytest --neuron --port hf --tp-degree 4 ...*"
        ]
    )


# -- a whole --neuron session (subprocess, stand-in SDK on PYTHONPATH) ----------------------


def test_neuron_session_sets_up_once_and_tears_down(project, monkeypatch):
    """Two layers, one process: the process group and parallel_state are set up once, for the
    first layer, and torn down at the end of the session (RecordingParallelState stand-in on
    PYTHONPATH; real "xla" process group and layers on the torch-xla CPU device)."""
    sdk = write_standin_sdk(project.path / "standin_sdk")
    record = project.path / "calls.jsonl"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(sdk), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("STANDIN_RECORD", str(record))
    for name in DIST_VARS:
        monkeypatch.delenv(name, raising=False)
    result = project.runpytest_subprocess(
        "--neuron", "--port", "hf", "--layers", "0-1", "--compile-cache=ncache", "-v", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([f"layerparity: compile cache {project.path / 'ncache'} (NEURON_COMPILE_CACHE_URL)"])
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert [c["call"] for c in calls] == ["initialize_model_parallel", "destroy_model_parallel"]
    init = calls[0]
    assert init["pg_backend"] == "xla" and init["pg_world_size"] == 1 and init["effective_tp"] == 1
    assert init["env"]["RANK"] == "0" and init["env"]["MASTER_ADDR"] == "localhost"
    assert init["env"]["NEURON_COMPILE_CACHE_URL"] == str(project.path / "ncache")
    assert (project.path / "ncache").is_dir()
    assert "pg_backend" not in calls[1] or calls[1]["pg_backend"] == "xla"


# -- torch-xla's persistent cache (real) ----------------------------------------------------


def test_xla_compile_cache_is_written_and_reread_by_a_second_session(project, tmp_path):
    """The first session stores its compiled graphs; the second finds them. On the torch-xla
    2.9 CPU client they cannot be loaded back (PJRT CPU does not deserialize executables), and
    the session says so rather than claim a speed-up."""
    cache = tmp_path / "xla-cache"
    first = project.runpytest_subprocess("--xla", "--layers", "0", f"--compile-cache={cache}", "-p", "no:cacheprovider")
    first.assert_outcomes(passed=1)
    first.stdout.fnmatch_lines(
        [
            f"layerparity: compile cache {cache} (torch-xla persistent cache)",
            f"layerparity: compile cache {cache}: 0 graphs loaded, * compiled and stored",
        ]
    )
    stored = sorted(p.name for p in cache.iterdir())
    assert stored
    second = project.runpytest_subprocess(
        "--xla", "--layers", "0", f"--compile-cache={cache}", "-p", "no:cacheprovider"
    )
    second.assert_outcomes(passed=1)
    line = [x for x in second.stdout.lines if x.startswith(f"layerparity: compile cache {cache}:")]
    assert line and (
        "found but not loadable" in line[0]
        or not line[0].startswith(f"layerparity: compile cache {cache}: 0 graphs loaded")
    )
    assert sorted(p.name for p in cache.iterdir()) == stored  # nothing new was stored: same graphs


def test_compile_cache_too_late_in_the_process_says_so(tmp_path, monkeypatch):
    import torch
    import torch_xla

    from pytest_layerparity.backends.xla import start_persistent_cache

    monkeypatch.delenv("XLA_PERSISTENT_CACHE_PATH", raising=False)
    (torch.ones(2, device=torch_xla.device()) + 1).cpu()  # something compiled in this process
    with pytest.raises(
        BackendUnavailable,
        match=r"can no longer be switched on .*start pytest in a fresh process, or set XLA_PERSISTENT_CACHE_PATH=",
    ):
        start_persistent_cache(str(tmp_path))


# -- the NxDI example (examples/nxdi_minimax_m2/conftest.py) --------------------------------
# Its NxDI half (NeuronMiniMaxM2DecoderLayer, NxDI's converter, NxD's sharding) needs the
# Neuron SDK and was not run here; its own code around them is tested below.

EXAMPLE = ROOT / "examples" / "nxdi_minimax_m2" / "conftest.py"


@pytest.fixture(scope="module")
def example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("nxdi_minimax_m2_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_gives_the_released_checkpoints_names_back(example):
    """transformers' fused expert tensors go back to the released checkpoint's per-expert
    w1/w2/w3 (what NxDI's converter reads), bit for bit, for every tensor of the layer."""
    import torch
    from safetensors import safe_open

    from pytest_layerparity.model import build as modeling
    from pytest_layerparity.model import checkpoint

    config = modeling.load_hf_config(DEFAULT_MODEL)
    skeleton = modeling.build_skeleton(config, torch.float32)
    layer = checkpoint.load_layer(skeleton, checkpoint.Checkpoint.open(DEFAULT_MODEL), "model.layers", 3, torch.float32)
    names = example.hf_layer_to_checkpoint_names(layer.state_dict(), 3)
    index = json.loads((DEFAULT_MODEL / "model.safetensors.index.json").read_text())["weight_map"]
    raw = {}
    for key, shard in index.items():
        if key.startswith("model.layers.3."):
            with safe_open(str(DEFAULT_MODEL / shard), "pt") as f:
                raw[key.removeprefix("model.")] = f.get_tensor(key)
    assert set(names) == set(raw)
    assert len([k for k in raw if ".experts." in k]) == 3 * config.num_local_experts
    for key, tensor in raw.items():
        assert torch.equal(names[key], tensor.float()), key


def test_example_turns_the_hf_call_into_nxdis(example):
    """RecordingNxDILayer stands in for NeuronMiniMaxM2DecoderLayer (no Neuron SDK here)."""
    import torch

    seen = {}

    class RecordingNxDILayer(torch.nn.Module):
        def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, **kwargs):
            seen.update(attention_mask=attention_mask, position_ids=position_ids, past_key_value=past_key_value)
            return (hidden_states + 1, None, None, None, None)

    hidden = torch.randn(2, 5, 8)
    cos_sin = (torch.ones(2, 5, 4), torch.zeros(2, 5, 4))
    out = example.HFCallToNxDI(RecordingNxDILayer())(
        hidden,
        position_embeddings=cos_sin,
        attention_mask=None,
        position_ids=torch.arange(5)[None].expand(2, 5),
        use_cache=False,
    )
    assert torch.equal(out, hidden + 1)
    mask = seen["attention_mask"]
    assert mask.dtype == torch.bool and mask.shape == (2, 1, 5, 5)
    assert torch.equal(mask[0, 0], torch.ones(5, 5, dtype=torch.bool).tril())
    assert seen["position_ids"].tolist() == [[0, 1, 2, 3, 4]] * 2 and seen["past_key_value"] is None
    additive = torch.zeros(1, 1, 5, 5).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    example.HFCallToNxDI(RecordingNxDILayer())(hidden[:1], attention_mask=additive)
    assert torch.equal(seen["attention_mask"][0, 0], torch.ones(5, 5, dtype=torch.bool).tril())
    assert seen["position_ids"].tolist() == [[0, 1, 2, 3, 4]]


def test_example_without_nxdi_says_where_to_point_it(example, monkeypatch):
    monkeypatch.delenv("NXDI_MINIMAX_M2_SRC", raising=False)
    with pytest.raises(ImportError, match=r"set NXDI_MINIMAX_M2_SRC to the folder holding its modeling_minimax_m2\.py"):
        example.import_nxdi_minimax_m2()
