"""Runs over several processes, the decisions: where this process stands in a torchrun
launch, and which devices and ports each xdist worker gets. Pure functions of the
environment, tested on their own; :mod:`.runs` applies them in a pytest run.

- torchrun (``torchrun --nproc_per_node=N -m pytest --neuron --port hf ...``, a layer run eagerly
  on the NeuronCores): every rank runs the same
  tests (tensor parallelism needs every rank in every collective); rank 0 reports (terminal,
  ``--junitxml``, ``--parity-report``), the other ranks run quietly and say one line on stderr
  when something failed there.
- xdist (``pytest -n N``): each worker is a process of its own, a world of one. With
  ``--neuron`` it gets ``layerparity_cores_per_worker`` NeuronCores of its own (``NEURON_RT_VISIBLE_CORES``),
  taken in order from the cores the controller sees, and its own ``MASTER_PORT``; with
  ``--gpu-golden`` or ``--target cuda`` it gets one GPU (``CUDA_VISIBLE_DEVICES``), round robin.
  The controller decides and hands each worker its variables (``workerinput``), which the worker
  sets before anything starts a runtime.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Collection, Mapping, MutableMapping
from dataclasses import dataclass

import pytest

NEURON_CORES = "NEURON_RT_VISIBLE_CORES"
CUDA_DEVICES = "CUDA_VISIBLE_DEVICES"


# -- pure decisions ---------------------------------------------------------------------


@dataclass(frozen=True)
class RankInfo:
    """Where this process stands in a torchrun launch (rank 0 of 1 outside torchrun)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    torchrun: bool

    @property
    def reports(self) -> bool:
        """True for the process that writes the terminal output and the report files."""
        return self.rank == 0


def rank_info(environ: Mapping[str, str] = os.environ) -> RankInfo:
    """Read torchrun's variables. torchrun (torch.distributed.elastic) always sets
    TORCHELASTIC_RUN_ID next to RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE."""
    torchrun = "TORCHELASTIC_RUN_ID" in environ
    if not torchrun:
        return RankInfo(0, 1, 0, 1, False)

    def number(name: str, default: int) -> int:
        try:
            return int(environ.get(name, default))
        except ValueError:
            raise pytest.UsageError(f"torchrun set {name}={environ[name]!r}, which is not a whole number") from None

    world = number("WORLD_SIZE", 1)
    return RankInfo(number("RANK", 0), world, number("LOCAL_RANK", 0), number("LOCAL_WORLD_SIZE", world), True)


def xdist_worker_index(workerid: str) -> int:
    """``gw3`` -> 3 (xdist names its workers gw0, gw1, ...)."""
    digits = workerid[2:] if workerid.startswith("gw") else ""
    if not digits.isdigit():
        raise ValueError(f"unexpected xdist worker id {workerid!r}; expected gw0, gw1, ...")
    return int(digits)


def parse_core_list(text: str) -> list[int]:
    """Read a NEURON_RT_VISIBLE_CORES value: ``0-3``, ``5``, ``0-1,4-5`` (the forms the Neuron
    runtime and torch-xla accept)."""
    cores: list[int] = []
    for raw in text.split(","):
        part = raw.strip()
        bounds = part.split("-")
        if not part or len(bounds) > 2 or not all(b.strip().isdigit() for b in bounds):
            raise ValueError(f"{NEURON_CORES}={text!r}: cannot read {part!r}; use forms like 0-3, 5 or 0-1,4-5")
        low, high = int(bounds[0]), int(bounds[-1])
        if low > high:
            raise ValueError(f"{NEURON_CORES}={text!r}: range {part} is reversed; write {high}-{low}")
        new = list(range(low, high + 1))
        if set(new) & set(cores):
            raise ValueError(f"{NEURON_CORES}={text!r}: the ranges overlap")
        cores.extend(new)
    return cores


def format_core_list(cores: list[int]) -> str:
    """``[2, 3]`` -> ``2-3``; ``[5]`` -> ``5``; non-contiguous -> ``0,2``."""
    if not cores:
        raise ValueError("no cores")
    if cores == list(range(cores[0], cores[0] + len(cores))):
        return str(cores[0]) if len(cores) == 1 else f"{cores[0]}-{cores[-1]}"
    return ",".join(str(c) for c in cores)


def worker_neuron_cores(index: int, cores_per_worker: int, visible: list[int] | None) -> str:
    """The NEURON_RT_VISIBLE_CORES of xdist worker ``index``: its own ``cores_per_worker``
    cores, in order, out of ``visible`` (the controller's NEURON_RT_VISIBLE_CORES) or out of
    0, 1, 2, ... when the controller sets none."""
    start = index * cores_per_worker
    if visible is None:
        return format_core_list(list(range(start, start + cores_per_worker)))
    mine = visible[start : start + cores_per_worker]
    if len(mine) < cores_per_worker:
        raise ValueError(
            f"worker {index} needs cores {start}-{start + cores_per_worker - 1} of {NEURON_CORES}, which has "
            f"{len(visible)}"
        )
    return format_core_list(mine)


def check_neuron_core_plan(workers: int, cores_per_worker: int, visible: list[int] | None) -> None:
    """Raise ValueError, saying what fits, when ``workers`` x ``cores_per_worker`` cores are not
    visible, or when several workers would go unpinned (``cores_per_worker`` 0): a Neuron runtime
    takes every core it can see, so the first worker's would hold them all."""
    if cores_per_worker == 0 and workers > 1:
        raise ValueError(
            f"-n {workers} with layerparity_cores_per_worker = 0 leaves the workers unpinned: the first worker's "
            "Neuron runtime takes every visible NeuronCore and the other workers cannot start theirs; give each "
            "worker its own: -o layerparity_cores_per_worker=1 (or more)"
        )
    if visible is None or cores_per_worker == 0:
        return
    needed = workers * cores_per_worker
    if needed > len(visible):
        fits = len(visible) // cores_per_worker
        raise ValueError(
            f"-n {workers} with layerparity_cores_per_worker = {cores_per_worker} needs {needed} NeuronCores, and "
            f"{NEURON_CORES}={format_core_list(visible)} has {len(visible)}; use -n {max(fits, 1)}"
            + ("" if fits else f" -o layerparity_cores_per_worker={len(visible)}")
            + f", or widen {NEURON_CORES}"
        )


def parse_cuda_devices(text: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list (None when unset; ``""`` hides every GPU)."""
    if text is None:
        return None
    return [d.strip() for d in text.split(",") if d.strip()]


def worker_cuda_device(index: int, devices: list[str]) -> str | None:
    """The GPU of xdist worker ``index``: round robin over ``devices`` (several workers share a
    GPU when there are more workers than GPUs). None when there is no GPU."""
    return devices[index % len(devices)] if devices else None


def free_port(host: str = "localhost") -> int:
    """A TCP port nothing listens on now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host if host != "localhost" else "127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_environment(
    index: int,
    *,
    neuron: bool,
    cores_per_worker: int,
    cuda_devices: list[str] | None,
    environ: Mapping[str, str] = os.environ,
) -> dict[str, str | None]:
    """The variables xdist worker ``index`` sets for itself (None: unset it).

    --neuron: its NeuronCores, and a world of one of its own (RANK 0, WORLD_SIZE 1, MASTER_PORT
    left to the backend, which picks a free port; NEURON_RT_ROOT_COMM_ID given a free port by
    the worker), so that workers do not rendezvous on one inherited port. cuda_devices: the
    GPUs to share out (None: leave CUDA_VISIBLE_DEVICES alone).
    """
    env: dict[str, str | None] = {}
    if neuron:
        if cores_per_worker:
            visible = environ.get(NEURON_CORES)
            env[NEURON_CORES] = worker_neuron_cores(
                index, cores_per_worker, parse_core_list(visible) if visible else None
            )
        env.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": None, "NEURON_RT_ROOT_COMM_ID": None})
    if cuda_devices is not None:
        device = worker_cuda_device(index, cuda_devices)
        if device is not None:
            env[CUDA_DEVICES] = device
    return env


def available_cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def thread_share(cores: int, processes: int, environ: Mapping[str, str] = os.environ) -> int | None:
    """The intra-op threads of one of ``processes`` processes sharing ``cores`` (xdist workers,
    or torchrun's ranks on this machine): its share, at least one; None where the user set
    OMP_NUM_THREADS or where one process has the cores to itself. Every process starting as
    many threads as there are cores makes each parallel region wait on a descheduled thread."""
    if processes <= 1 or environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, cores // processes)


def idle_threads_sleep(environ: MutableMapping[str, str] = os.environ, modules: Collection[str] = ()) -> bool:
    """Before torch loads its OpenMP runtime: its idle threads sleep rather than spin
    (OMP_WAIT_POLICY=PASSIVE, unless the user chose). A layer's hundreds of small operations
    each end with the threads waiting: spinning, they hold the cores another process needs,
    and on a busy machine every operation then waits on a descheduled thread (extracting one
    layer of the embedded model beside two other jobs: 115 s spinning, 28 s sleeping, 24 s on
    one thread). Returns whether it set it (not once torch is imported: too late)."""
    if "torch" in modules or "OMP_WAIT_POLICY" in environ:
        return False
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def apply_environment(env: Mapping[str, str | None], environ: MutableMapping[str, str] = os.environ) -> None:
    for key, value in env.items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value


def check_tp_degree(tp_degree: int, ranks: RankInfo) -> None:
    """neuronx-distributed caps tensor_model_parallel_size at the world size without a word;
    refuse that here, saying how to launch the ranks."""
    world = ranks.world_size
    if tp_degree > world:
        raise ValueError(
            f"--tp-degree {tp_degree} needs {tp_degree} processes, one per NeuronCore, and this run has "
            f"WORLD_SIZE={world} (neuronx-distributed would quietly use tensor_model_parallel_size={world}); "
            f"launch the ranks with: torchrun --nproc_per_node={tp_degree} -m pytest --neuron --port hf "
            f"--tp-degree {tp_degree} ..."
        )
    if world % tp_degree:
        raise ValueError(
            f"WORLD_SIZE={world} is not a multiple of --tp-degree {tp_degree}; use --nproc_per_node={tp_degree} (or a "
            "multiple)"
        )


def check_cpu_tp_degree(tp_degree: int, ranks: RankInfo) -> None:
    """NxD's CPU mode shards each layer over one process per rank: ``--tp-degree`` must be
    torchrun's WORLD_SIZE (a run that cannot shard is refused, never run unsharded)."""
    world = ranks.world_size
    if tp_degree == world:
        return
    launch = (
        f"python -m torch.distributed.run --nproc-per-node {tp_degree} -m pytest --port nxdi --target cpu "
        f"--tp-degree {tp_degree} ..."
    )
    if not ranks.torchrun:
        raise ValueError(
            f"--tp-degree {tp_degree} shards each layer over {tp_degree} processes, one per rank, and this is one "
            f"process; launch the ranks with: {launch} (python -m torch.distributed.run from the NxDI environment: "
            "it has no torchrun script of its own)"
        )
    raise ValueError(
        f"--tp-degree {tp_degree} needs one rank per shard, and torchrun started WORLD_SIZE={world}; launch them "
        f"with: {launch}"
    )
