"""Runs over several processes: xdist workers pinned to their own NeuronCores / GPU, torchrun
ranks (rank 0 reports), extraction from several workers into one store.

Real here: xdist, torchrun, the environment each process sees, torch.distributed's "xla"
process group on the torch-xla CPU device (two ranks under torchrun). Against a stand-in:
neuronx-distributed's parallel_state (``RecordingParallelState`` in tests/standin_neuron_sdk.py;
the Neuron SDK cannot be installed here). There are no NeuronCores and no GPUs here, so what
is checked is the variables each worker gets, not a runtime honouring them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from standin_neuron_sdk import write_standin_sdk

# A conftest that records, per process, the variables the plugin set and the tests it ran.
RECORD_ENV = """
import json, os
from pathlib import Path

RAN = []

class Recorder:  # a plugin, not a conftest hook: conftest runtest hooks skip the plugin's own tests
    def pytest_runtest_logreport(self, report):
        if report.when == "call":
            RAN.append((report.nodeid, report.outcome))

def pytest_configure(config):
    config.pluginmanager.register(Recorder())

def pytest_sessionfinish(session):
    rank = "rank" + os.environ["RANK"] if "TORCHELASTIC_RUN_ID" in os.environ else "main"
    who = os.environ.get("PYTEST_XDIST_WORKER") or rank
    names = ("NEURON_RT_VISIBLE_CORES", "CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "MASTER_PORT",
             "NEURON_RT_ROOT_COMM_ID")
    out = Path(os.environ["ENV_RECORD_DIR"]) / (who + ".json")
    out.write_text(json.dumps({"env": {k: os.environ.get(k) for k in names}, "ran": RAN}))
"""

DIST_VARS = (
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "PYTEST_XDIST_WORKER",
    "PYTEST_XDIST_WORKER_COUNT",
    "NEURON_RT_VISIBLE_CORES",
    "CUDA_VISIBLE_DEVICES",
    "NEURON_COMPILE_CACHE_URL",
    "NEURON_CC_FLAGS",
)


# -- usage errors (in process: they stop the run before any worker starts) --------------------


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (
            ["--neuron", "-n", "2", "-o", "layerparity_cores_per_worker=2"],
            {"NEURON_RT_VISIBLE_CORES": "0-2"},
            "*--neuron: -n 2 with layerparity_cores_per_worker = 2 needs 4 NeuronCores, and "
            "NEURON_RT_VISIBLE_CORES=0-2 has 3; use -n 1, or widen NEURON_RT_VISIBLE_CORES*",
        ),
        (
            ["--target", "cpu", "-n", "2"],
            {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2"},
            "*-n 2 under torchrun: every rank must run the same tests in the same order*drop -n*",
        ),
        (
            ["--gpu-golden", "--extract"],
            {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2"},
            "*--gpu-golden under torchrun (WORLD_SIZE=2): the reference runs in one process*",
        ),
    ],
)
def test_distributed_usage_errors(project, monkeypatch, args, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = project.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


# -- real runs ---------------------------------------------------------------------------------


@pytest.fixture
def recorded(project, monkeypatch):
    """The project with the env-recording conftest and the stand-in Neuron SDK on PYTHONPATH."""
    for name in DIST_VARS:
        monkeypatch.delenv(name, raising=False)
    project.makeconftest(RECORD_ENV)
    records = project.mkdir("envs")
    sdk = write_standin_sdk(project.path / "standin_sdk")
    monkeypatch.setenv("ENV_RECORD_DIR", str(records))
    monkeypatch.setenv("STANDIN_RECORD", str(project.path / "calls.jsonl"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(sdk), os.environ.get("PYTHONPATH", "")]))

    def read():
        env = {p.stem: json.loads(p.read_text()) for p in records.iterdir()}
        calls_path = project.path / "calls.jsonl"
        calls = [json.loads(x) for x in calls_path.read_text().splitlines()] if calls_path.exists() else []
        return env, calls

    project.read_records = read
    return project


def test_xdist_workers_get_their_own_neuroncores_and_rendezvous(recorded, monkeypatch):
    """-n 2 --neuron -o layerparity_cores_per_worker=2 under NEURON_RT_VISIBLE_CORES=4-7 and an exported
    MASTER_PORT (the seeds' habit): each worker gets two cores of its own and a world of one of
    its own on its own port, so both set up their process group (real) and parallel_state
    (RecordingParallelState stand-in) side by side."""
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4-7")
    monkeypatch.setenv("MASTER_PORT", "12355")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    two_workers = ("-n", "2", "-o", "layerparity_cores_per_worker=2")
    result = recorded.runpytest_subprocess(
        "--neuron", "--port", "hf", *two_workers, "--layers", "0-1", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=2)
    env, calls = recorded.read_records()
    assert {w: r["env"]["NEURON_RT_VISIBLE_CORES"] for w, r in env.items() if w.startswith("gw")} == {
        "gw0": "4-5",
        "gw1": "6-7",
    }
    assert env["main"]["env"]["NEURON_RT_VISIBLE_CORES"] == "4-7"  # the controller keeps the pool
    comm = [env[w]["env"]["NEURON_RT_ROOT_COMM_ID"] for w in ("gw0", "gw1")]
    assert all(c and c.startswith("localhost:") for c in comm) and comm[0] != comm[1]
    inits = [c for c in calls if c["call"] == "initialize_model_parallel"]
    assert inits and all(c["pg_world_size"] == 1 and c["env"]["WORLD_SIZE"] == "1" for c in inits)
    ports = {c["env"]["PYTEST_XDIST_WORKER"]: c["env"]["MASTER_PORT"] for c in inits}
    assert "12355" not in ports.values() and len(set(ports.values())) == len(ports)
    assert {c["env"]["PYTEST_XDIST_WORKER"]: c["env"]["NEURON_RT_VISIBLE_CORES"] for c in inits} == {
        w: {"gw0": "4-5", "gw1": "6-7"}[w] for w in ports
    }
    assert len([c for c in calls if c["call"] == "destroy_model_parallel"]) == len(inits)


def test_extraction_from_two_workers_writes_one_store_and_each_gets_a_gpu(recorded, monkeypatch):
    """--gpu-golden --extract -n 2 with CUDA_VISIBLE_DEVICES=3,5: each worker is given one of
    them (no GPU here, so the reference runs on the CPU), and the two workers' layers land in
    one consistent store that the parity tests then use."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    shutil.rmtree(recorded.path / "goldens")
    result = recorded.runpytest_subprocess("--gpu-golden", "--extract", "-n", "2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=6)
    env, _ = recorded.read_records()
    assert {w: r["env"]["CUDA_VISIBLE_DEVICES"] for w, r in env.items()} == {"main": "3,5", "gw0": "3", "gw1": "5"}
    assert all(r["ran"] for w, r in env.items() if w.startswith("gw"))  # both workers extracted layers
    manifest = json.loads((recorded.path / "goldens" / "manifest.json").read_text())
    assert {f"layer_{i}" for i in range(6)} | {"model_io"} <= set(manifest["files"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    check = recorded.runpytest_subprocess("--target", "cpu", "-p", "no:cacheprovider")
    check.assert_outcomes(passed=6)


PLANT_ON_RANK_1 = """
import os, pytest

@pytest.hookimpl
def pytest_layerparity_build_target_layer(layer_idx, reference_layer, model_config, device):
    if layer_idx == 1 and os.environ.get("RANK") == "1":
        reference_layer.input_layernorm.variance_epsilon = 0.5  # a bug on rank 1 only
    return None
"""


def test_torchrun_two_ranks_rank0_reports(recorded, tmp_path):
    """torchrun --nproc_per_node=2 -m pytest --neuron --tp-degree 2: both ranks set up the
    "xla" process group with torchrun's RANK/WORLD_SIZE/MASTER_PORT (real, two processes) and
    parallel_state with tensor parallelism 2 (RecordingParallelState stand-in), both run the
    same tests; rank 0 alone writes the terminal output, the JUnit file and the report; rank 1
    runs quietly and says on stderr that a test failed there."""
    from pytest_layerparity.distributed.env import free_port

    (recorded.path / "conftest.py").write_text(RECORD_ENV + PLANT_ON_RANK_1)
    port = free_port()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [
        torchrun,
        "--nproc_per_node=2",
        f"--master-port={port}",
        "-m",
        "pytest",
        "--neuron",
        "--tp-degree",
        "2",
        "--layers",
        "0-1",
        "--junitxml=out.xml",
        "--parity-report",
        "rep",
        "-p",
        "no:cacheprovider",
    ]
    done = subprocess.run(command, cwd=recorded.path, capture_output=True, text=True, timeout=300, check=False)
    out, err = done.stdout, done.stderr
    assert done.returncode != 0, out + err  # rank 1 failed, so torchrun fails
    assert out.count("test session starts") == 1 and out.count("2 passed") == 1, out
    assert (
        "layerparity: torchrun rank 0 of 2 (local 0 of 2); rank 0 reports, the other ranks run the same tests quietly"
        in out
    )
    assert "rank 1 of 2 (local" not in out
    assert (
        "layerparity: torchrun rank 1 of 2: 1 failed, 1 passed (exit status 1); rank 0's output lists the same tests"
        in err
    )
    cases = ET.parse(recorded.path / "out.xml").findall(".//testcase")
    assert len(cases) == 2 and not ET.parse(recorded.path / "out.xml").findall(".//failure")
    assert len(json.loads((recorded.path / "rep" / "report.json").read_text())["tests"]) == 2
    env, calls = recorded.read_records()
    assert {w: [o for _, o in r["ran"]] for w, r in env.items()} == {
        "rank0": ["passed", "passed"],
        "rank1": ["passed", "failed"],
    }
    inits = sorted((c for c in calls if c["call"] == "initialize_model_parallel"), key=lambda c: c["pg_rank"])
    assert [(c["pg_backend"], c["pg_rank"], c["pg_world_size"], c["effective_tp"]) for c in inits] == [
        ("xla", 0, 2, 2),
        ("xla", 1, 2, 2),
    ]
    assert {c["env"]["MASTER_PORT"] for c in inits} == {str(port)}
    assert [c["env"]["RANK"] for c in inits] == ["0", "1"]
