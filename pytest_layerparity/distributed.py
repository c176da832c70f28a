"""Runs over several processes: torchrun ranks, xdist workers pinned to their own devices,
and the compile cache's location.

- torchrun (``torchrun --nproc_per_node=N -m pytest --neuron ...``): every rank runs the same
  tests (tensor parallelism needs every rank in every collective); rank 0 reports (terminal,
  ``--junitxml``, ``--parity-report``), the other ranks run quietly and say one line on stderr
  when something failed there.
- xdist (``pytest -n N``): each worker is a process of its own, a world of one. With
  ``--neuron`` it gets ``--cores-per-worker`` NeuronCores of its own (``NEURON_RT_VISIBLE_CORES``),
  taken in order from the cores the controller sees, and its own ``MASTER_PORT``; with
  ``--gpu-golden`` or ``--target cuda`` it gets one GPU (``CUDA_VISIBLE_DEVICES``), round robin.
  The controller decides and hands each worker its variables (``workerinput``), which the worker
  sets before anything starts a runtime.

The decisions are pure functions of the environment, tested on their own; :class:`DistributedRuns`
applies them at the right moments of a pytest run.
"""
from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, MutableMapping

import pytest

NEURON_CORES = "NEURON_RT_VISIBLE_CORES"
CUDA_DEVICES = "CUDA_VISIBLE_DEVICES"
WORKERINPUT_KEY = "layerparity_env"
PLUGIN_NAME = "layerparity-distributed"


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
    for part in text.split(","):
        part = part.strip()
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
    mine = visible[start:start + cores_per_worker]
    if len(mine) < cores_per_worker:
        raise ValueError(f"worker {index} needs cores {start}-{start + cores_per_worker - 1} of {NEURON_CORES}, which has {len(visible)}")
    return format_core_list(mine)


def check_neuron_core_plan(workers: int, cores_per_worker: int, visible: list[int] | None) -> None:
    """Raise ValueError, saying what fits, when ``workers`` x ``cores_per_worker`` cores are not visible."""
    if visible is None or cores_per_worker == 0:
        return
    needed = workers * cores_per_worker
    if needed > len(visible):
        fits = len(visible) // cores_per_worker
        raise ValueError(
            f"-n {workers} with --cores-per-worker {cores_per_worker} needs {needed} NeuronCores, and "
            f"{NEURON_CORES}={format_core_list(visible)} has {len(visible)}; use -n {max(fits, 1)}"
            + ("" if fits else f" --cores-per-worker {len(visible)}")
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
            env[NEURON_CORES] = worker_neuron_cores(index, cores_per_worker, parse_core_list(visible) if visible else None)
        env.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": None, "NEURON_RT_ROOT_COMM_ID": None})
    if cuda_devices is not None:
        device = worker_cuda_device(index, cuda_devices)
        if device is not None:
            env[CUDA_DEVICES] = device
    return env


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
            f"launch the ranks with: torchrun --nproc_per_node={tp_degree} -m pytest --neuron --tp-degree {tp_degree} ..."
        )
    if world % tp_degree:
        raise ValueError(f"WORLD_SIZE={world} is not a multiple of --tp-degree {tp_degree}; use --nproc_per_node={tp_degree} (or a multiple)")


def is_url(location: str) -> bool:
    return "://" in location


def resolve_cache_location(value: str, base: Path) -> str:
    """A local --compile-cache folder made absolute against ``base``; URLs (s3://, for Neuron's
    cache) are kept as they are."""
    if is_url(value) or Path(value).is_absolute():
        return value
    return str(base / value)


# -- applying them in a pytest run -------------------------------------------------------


def _mode_flags(config: pytest.Config) -> dict[str, Any]:
    get = config.getoption
    target = get("layerparity_target", None)
    gpu_golden = bool(get("layerparity_gpu_golden", False))
    neuron = bool(get("layerparity_neuron", False)) or target == "neuron"
    cuda = target == "cuda" or (gpu_golden and _golden_device_choice(config) in ("auto", "cuda"))
    xla = bool(get("layerparity_xla", False)) or target == "xla"
    active = gpu_golden or neuron or xla or target is not None
    return {"neuron": neuron, "xla": xla, "cuda": cuda, "gpu_golden": gpu_golden, "active": active}


def _ini_or_option(config: pytest.Config, dest: str) -> Any:
    value = config.getoption(f"layerparity_{dest}", None)
    if value is None:
        raw = config.getini(f"layerparity_{dest}")
        value = raw if raw not in (None, "", []) else None
    return value


def _golden_device_choice(config: pytest.Config) -> str:
    value = _ini_or_option(config, "golden_device")
    return str(value).strip().lower() if value else "auto"


def _cores_per_worker(config: pytest.Config) -> int:
    value = _ini_or_option(config, "cores_per_worker")
    if value is None:
        return 1
    try:
        number = int(value)
    except ValueError:
        raise pytest.UsageError(f"ini option layerparity_cores_per_worker = {value!r}: not a whole number; give 0 or more") from None
    if number < 0:
        raise pytest.UsageError(f"ini option layerparity_cores_per_worker = {value!r}: must be 0 or more")
    return number


def _xdist_workers(config: pytest.Config) -> int:
    """How many xdist workers this controller starts (0 without xdist)."""
    if hasattr(config, "workerinput"):
        return 0
    if config.getoption("dist", "no") == "no":
        return 0
    return len(config.getoption("tx", None) or [])


class DistributedRuns:
    """Registered by the plugin before every other pytest_configure implementation (so that it
    sees the options before junitxml and the session read them)."""

    def __init__(self) -> None:
        self.ranks = rank_info()
        self.active = False
        self.quiet = False
        self.failed = 0
        self.passed = 0
        self.neuron = False
        self.xla = False
        self.cuda = False
        self.cores_per_worker = 1
        self.cuda_pool: list[str] | None = None
        self.worker_env: dict[str, str | None] = {}

    # pytest_configure is historic: registered during the plugin's tryfirst pytest_configure,
    # this runs at once, before junitxml, the terminal reporter and the layerparity session.
    def pytest_configure(self, config: pytest.Config) -> None:
        flags = _mode_flags(config)
        if not flags["active"]:
            return  # no layerparity mode: other test suites run under torchrun or xdist as they would without the plugin
        self.active = True
        self.neuron, self.xla, self.cuda = flags["neuron"], flags["xla"], flags["cuda"]
        self._resolve_compile_cache(config)
        workerinput = getattr(config, "workerinput", None)
        if workerinput is not None:
            self.worker_env = dict(workerinput.get(WORKERINPUT_KEY) or {})
            if self.neuron and "NEURON_RT_ROOT_COMM_ID" in self.worker_env:
                # torch-xla's Neuron plugin would give every worker localhost:62182 for the
                # runtime's collectives bootstrap; each world of one gets a port of its own.
                self.worker_env["NEURON_RT_ROOT_COMM_ID"] = f"localhost:{free_port()}"
            apply_environment(self.worker_env)
            return
        workers = _xdist_workers(config)
        if self.ranks.torchrun and self.ranks.world_size > 1:
            if workers:
                raise pytest.UsageError(
                    f"-n {workers} under torchrun: every rank must run the same tests in the same order (tensor "
                    "parallelism runs collectives across ranks), and xdist would split them differently on each "
                    "rank; drop -n (torchrun already runs one pytest per rank)"
                )
            if flags["gpu_golden"]:
                raise pytest.UsageError(
                    f"--gpu-golden under torchrun (WORLD_SIZE={self.ranks.world_size}): the reference runs in one "
                    "process; run pytest --gpu-golden --extract without torchrun (add -n N to spread layers over workers)"
                )
        if self.neuron:
            tp = _ini_or_option(config, "tp_degree")
            try:
                tp_degree = int(tp) if tp is not None else 1
            except ValueError:
                tp_degree = 0  # not a number: the option's own parser says so
            try:
                if tp_degree > 0:
                    check_tp_degree(tp_degree, self.ranks)
            except ValueError as exc:
                raise pytest.UsageError(f"--neuron: {exc}") from None
        if workers:
            self._plan_workers(config, workers)
        if self.ranks.torchrun and not self.ranks.reports:
            self.quiet = True
            config.option.xmlpath = None  # junitxml: rank 0 writes the one file
            config.option.layerparity_parity_report = None

    def _resolve_compile_cache(self, config: pytest.Config) -> None:
        value = config.getoption("layerparity_compile_cache", None)
        if value is not None:
            base = Path(config.invocation_params.dir)
        else:
            raw = config.getini("layerparity_compile_cache")
            if raw in (None, "", []):
                return
            value = str(raw)
            base = Path(config.inipath).parent if config.inipath else Path(config.invocation_params.dir)
        config.option.layerparity_compile_cache = resolve_cache_location(value, base)

    def _plan_workers(self, config: pytest.Config, workers: int) -> None:
        self.cores_per_worker = _cores_per_worker(config)
        if self.neuron:
            visible = os.environ.get(NEURON_CORES)
            try:
                check_neuron_core_plan(workers, self.cores_per_worker, parse_core_list(visible) if visible else None)
            except ValueError as exc:
                raise pytest.UsageError(f"--neuron: {exc}") from None
        if self.cuda:
            pool = parse_cuda_devices(os.environ.get(CUDA_DEVICES))
            if pool is None:
                import torch

                # Counting GPUs initialises CUDA in the controller only; it runs no tests.
                pool = [str(i) for i in range(torch.cuda.device_count())]
            self.cuda_pool = pool

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        """xdist controller: hand worker gwN the variables it sets for itself."""
        index = xdist_worker_index(node.workerinput["workerid"])
        node.workerinput[WORKERINPUT_KEY] = worker_environment(
            index, neuron=self.neuron, cores_per_worker=self.cores_per_worker, cuda_devices=self.cuda_pool,
        )

    def pytest_report_header(self, config: pytest.Config) -> list[str] | None:
        lines = []
        if not self.active:
            return None
        if self.ranks.torchrun:
            lines.append(
                f"layerparity: torchrun rank {self.ranks.rank} of {self.ranks.world_size} "
                f"(local {self.ranks.local_rank} of {self.ranks.local_world_size}); rank 0 reports, the other ranks run the same tests quietly"
            )
        cache = config.getoption("layerparity_compile_cache", None)
        if cache:
            kind = ("NEURON_COMPILE_CACHE_URL" if self.neuron else "torch-xla persistent cache" if self.xla
                    else "unused: only --xla and --neuron compile graphs")
            lines.append(f"layerparity: compile cache {cache} ({kind})")
        return lines or None

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if not self.quiet:
            return
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            from _pytest.config import create_terminal_writer

            # Kept open to the end of the process: the reporter writes up to its own unconfigure.
            reporter._tw = create_terminal_writer(session.config, open(os.devnull, "w"))  # noqa: SIM115

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.failed += 1
        elif report.passed and report.when == "call":
            self.passed += 1

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.quiet and (self.failed or exitstatus not in (0, 5)):
            line = (f"layerparity: torchrun rank {self.ranks.rank} of {self.ranks.world_size}: {self.failed} failed, "
                    f"{self.passed} passed (exit status {int(exitstatus)}); rank 0's output lists the same tests\n")
            os.write(sys.__stderr__.fileno() if sys.__stderr__ else 2, line.encode())

    def pytest_terminal_summary(self, terminalreporter: Any, config: pytest.Config) -> None:
        """Say what the compile cache did in this process (not known to an xdist controller)."""
        from .plugin import SESSION_KEY

        session = config.stash.get(SESSION_KEY, None)
        backend = getattr(session, "_backend", None)
        summary = getattr(backend, "cache_summary", None)
        line = summary() if callable(summary) else None
        if line:
            terminalreporter.write_line(f"layerparity: {line}")
