"""The decisions of runs over several processes, as pure functions: which cores, GPUs and
ports each xdist worker gets, where a torchrun rank stands, where the compile cache lives."""

from __future__ import annotations

import pytest

from pytest_layerparity.distributed.env import (
    RankInfo,
    check_neuron_core_plan,
    check_tp_degree,
    format_core_list,
    parse_core_list,
    parse_cuda_devices,
    rank_info,
    worker_cuda_device,
    worker_environment,
    worker_neuron_cores,
    xdist_worker_index,
)
from pytest_layerparity.options import resolve_cache_location


def test_worker_ids():
    assert [xdist_worker_index(w) for w in ("gw0", "gw3", "gw12")] == [0, 3, 12]
    with pytest.raises(ValueError, match="expected gw0, gw1"):
        xdist_worker_index("master")


@pytest.mark.parametrize(
    ("text", "cores"), [("0-3", [0, 1, 2, 3]), ("5", [5]), ("0-1,4-5", [0, 1, 4, 5]), (" 8 - 9 ", [8, 9])]
)
def test_core_lists(text, cores):
    assert parse_core_list(text) == cores


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("3-1", "range 3-1 is reversed; write 1-3"),
        ("a", "cannot read 'a'"),
        ("0-3,2", "the ranges overlap"),
        ("1-2-3", "cannot read '1-2-3'"),
    ],
)
def test_bad_core_lists(text, message):
    with pytest.raises(ValueError, match=message):
        parse_core_list(text)


def test_core_list_formats():
    assert [format_core_list(c) for c in ([2, 3], [5], [0, 2], [4, 5, 6, 7])] == ["2-3", "5", "0,2", "4-7"]


def test_each_worker_gets_its_own_cores():
    assert [worker_neuron_cores(i, 1, None) for i in range(4)] == ["0", "1", "2", "3"]
    assert [worker_neuron_cores(i, 2, None) for i in range(4)] == ["0-1", "2-3", "4-5", "6-7"]
    # the controller's NEURON_RT_VISIBLE_CORES is the pool the workers share out
    pool = parse_core_list("8-15")
    assert [worker_neuron_cores(i, 4, pool) for i in range(2)] == ["8-11", "12-15"]
    assert [worker_neuron_cores(i, 1, [0, 1, 4, 5]) for i in range(4)] == ["0", "1", "4", "5"]
    assert worker_neuron_cores(1, 2, [0, 1, 4, 5]) == "4-5"


def test_too_few_cores_says_what_fits():
    check_neuron_core_plan(4, 2, list(range(8)))
    check_neuron_core_plan(16, 2, None)  # unknown pool: the runtime will say
    with pytest.raises(
        ValueError,
        match=r"-n 4 with layerparity_cores_per_worker = 2 needs 8 NeuronCores, and NEURON_RT_VISIBLE_CORES=0-3 "
        r"has 4; use -n 2, or widen NEURON_RT_VISIBLE_CORES",
    ):
        check_neuron_core_plan(4, 2, [0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"use -n 1 -o layerparity_cores_per_worker=3"):
        check_neuron_core_plan(2, 4, [0, 1, 2])
    check_neuron_core_plan(1, 0, None)  # one worker, unpinned: its runtime may take every core
    with pytest.raises(
        ValueError,
        match=r"-n 2 with layerparity_cores_per_worker = 0 leaves the workers unpinned.*-o layerparity_cores_per",
    ):
        check_neuron_core_plan(2, 0, None)


def test_each_worker_gets_a_gpu_round_robin():
    assert parse_cuda_devices(None) is None
    assert parse_cuda_devices("") == []
    assert parse_cuda_devices("2, 3") == ["2", "3"]
    assert [worker_cuda_device(i, ["0", "1"]) for i in range(4)] == ["0", "1", "0", "1"]
    assert worker_cuda_device(0, []) is None


def test_worker_environment():
    env = worker_environment(
        1, neuron=True, cores_per_worker=2, cuda_devices=None, environ={"NEURON_RT_VISIBLE_CORES": "4-7"}
    )
    assert env == {
        "NEURON_RT_VISIBLE_CORES": "6-7",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_PORT": None,
        "NEURON_RT_ROOT_COMM_ID": None,
    }
    assert "NEURON_RT_VISIBLE_CORES" not in worker_environment(
        1, neuron=True, cores_per_worker=0, cuda_devices=None, environ={}
    )
    assert worker_environment(3, neuron=False, cores_per_worker=1, cuda_devices=["5", "6"], environ={}) == {
        "CUDA_VISIBLE_DEVICES": "6"
    }
    assert worker_environment(3, neuron=False, cores_per_worker=1, cuda_devices=[], environ={}) == {}


def test_rank_info_reads_torchrun():
    assert rank_info({}) == RankInfo(0, 1, 0, 1, False)
    assert rank_info({"RANK": "3", "WORLD_SIZE": "8"}) == RankInfo(0, 1, 0, 1, False)  # not torchrun: a world of one
    env = {"TORCHELASTIC_RUN_ID": "none", "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    info = rank_info(env)
    assert info == RankInfo(3, 8, 1, 2, True) and not info.reports


def test_tp_degree_against_the_world_size():
    check_tp_degree(1, RankInfo(0, 1, 0, 1, False))
    check_tp_degree(2, RankInfo(0, 4, 0, 4, True))
    with pytest.raises(ValueError, match="torchrun --nproc_per_node=2 -m pytest --neuron --port hf --tp-degree 2"):
        check_tp_degree(2, RankInfo(0, 1, 0, 1, False))
    with pytest.raises(ValueError, match="WORLD_SIZE=6 is not a multiple of --tp-degree 4"):
        check_tp_degree(4, RankInfo(0, 6, 0, 6, True))


def test_cache_locations(tmp_path):
    assert resolve_cache_location("cache", tmp_path) == str(tmp_path / "cache")
    assert resolve_cache_location("/abs/cache", tmp_path) == "/abs/cache"
    assert resolve_cache_location("s3://bucket/neuron", tmp_path) == "s3://bucket/neuron"


@pytest.mark.parametrize(
    ("cores", "processes", "environ", "threads"),
    [
        (2, 2, {}, 1),
        (16, 4, {}, 4),
        (16, 3, {}, 5),
        (2, 4, {}, 1),  # more processes than cores: one thread each
        (16, 1, {}, None),  # one process: torch's own choice
        (16, 4, {"OMP_NUM_THREADS": "8"}, None),  # the user's choice stands
    ],
)
def test_each_process_takes_its_share_of_the_cores(cores, processes, environ, threads):
    from pytest_layerparity.distributed.env import thread_share

    assert thread_share(cores, processes, environ) == threads


def test_idle_threads_are_set_to_sleep_before_torch_loads_unless_the_user_chose():
    from pytest_layerparity.distributed.env import idle_threads_sleep

    environ: dict[str, str] = {}
    assert idle_threads_sleep(environ, modules=()) and environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    chosen = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert not idle_threads_sleep(chosen, modules=()) and chosen == {"OMP_WAIT_POLICY": "ACTIVE"}
    late: dict[str, str] = {}
    assert not idle_threads_sleep(late, modules=("torch",)) and late == {}  # its runtime already read it
