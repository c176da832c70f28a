"""Runs over several processes, applied to a pytest run: torchrun ranks (rank 0 reports, the
others run quietly) and xdist workers (each handed its own devices and ports by the
controller). The decisions themselves are the pure functions of :mod:`.env`; the options
come from :func:`pytest_layerparity.options.read_settings` like everywhere else."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from ..options import RunMode, Settings, read_settings
from .env import (
    CUDA_DEVICES,
    NEURON_CORES,
    RankInfo,
    apply_environment,
    available_cores,
    check_cpu_tp_degree,
    check_neuron_core_plan,
    check_tp_degree,
    free_port,
    parse_core_list,
    parse_cuda_devices,
    rank_info,
    thread_share,
    worker_environment,
    xdist_worker_index,
)

WORKERINPUT_KEY = "layerparity_env"
PLUGIN_NAME = "layerparity-distributed"


def uses_cuda(settings: Settings) -> bool:
    """Whether this run puts work on GPUs (so that xdist workers each get one)."""
    return settings.target_name == "cuda" or (settings.gpu_golden and settings.golden_device in ("auto", "cuda"))


def quiet_secondary_rank(config: pytest.Config) -> bool:
    """Before pytest configures: on a torchrun rank other than 0 of a layerparity run, switch
    off the terminal output and the JUnit file (rank 0 writes them). Returns whether it did."""
    ranks = rank_info()
    if not ranks.torchrun or ranks.reports or read_settings(config).mode is None:
        return False
    config.option.xmlpath = None
    config.pluginmanager.set_blocked("terminalreporter")
    return True


def _xdist_workers(config: pytest.Config) -> int:
    """How many xdist workers this controller starts (0 without xdist)."""
    if hasattr(config, "workerinput"):
        return 0
    if config.getoption("dist", "no") == "no":
        return 0
    return len(config.getoption("tx", None) or [])


def share_cores(processes: int) -> None:
    """This process's share of the machine's cores as torch's intra-op threads (see
    :func:`thread_share`)."""
    threads = thread_share(available_cores(), processes)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


class DistributedRuns:
    """Registered by the plugin in its pytest_configure (so this one's runs at once)."""

    def __init__(self, settings: Settings, ranks: RankInfo | None = None) -> None:
        self.settings = settings
        self.ranks = ranks or rank_info()
        self.active = settings.mode is not None
        self.neuron = settings.target_name == "neuron"
        self.compiled = settings.compiled  # NxDI's programs, compiled once per layer kind
        self.xla = settings.target_name == "xla"
        self.cuda = uses_cuda(settings)
        self.quiet = self.active and self.ranks.torchrun and not self.ranks.reports
        self.failed = 0
        self.passed = 0
        self.cuda_pool: list[str] | None = None

    def pytest_configure(self, config: pytest.Config) -> None:
        if not self.active:
            # no layerparity mode: other test suites run under torchrun or xdist as they would without the plugin
            return
        workerinput = getattr(config, "workerinput", None)
        if workerinput is not None:
            env = dict(workerinput.get(WORKERINPUT_KEY) or {})
            if self.neuron and "NEURON_RT_ROOT_COMM_ID" in env:
                # torch-xla's Neuron plugin would give every worker localhost:62182 for the
                # runtime's collectives bootstrap; each world of one gets a port of its own.
                env["NEURON_RT_ROOT_COMM_ID"] = f"localhost:{free_port()}"
            apply_environment(env)
            share_cores(int(workerinput.get("workercount", 1)))
            return
        if self.ranks.torchrun:
            share_cores(self.ranks.local_world_size)
        workers = _xdist_workers(config)
        self._check_torchrun(workers)
        if self.compiled:
            self._check_compiled(workers)
        elif self.settings.port == "nxdi" and self.settings.target_name == "cpu":
            try:
                check_cpu_tp_degree(self.settings.tp_degree, self.ranks)
            except ValueError as exc:
                raise pytest.UsageError(f"--port nxdi --target cpu: {exc}") from None
        elif self.neuron:
            try:
                check_tp_degree(self.settings.tp_degree, self.ranks)
            except ValueError as exc:
                raise pytest.UsageError(f"--neuron: {exc}") from None
        if workers:
            self._plan_workers(workers)

    def _check_compiled(self, workers: int) -> None:
        """--port nxdi --target neuron: one process drives each program over tp_degree cores."""
        tp = self.settings.tp_degree
        if self.ranks.torchrun and self.ranks.world_size > 1:
            raise pytest.UsageError(
                f"--port nxdi --target neuron compiles each layer for {tp} NeuronCore(s) and runs it from one process "
                f"(NxDI's ModelBuilder); this run has WORLD_SIZE={self.ranks.world_size}: drop torchrun"
            )
        cores = self.settings.cores_per_worker
        if workers and 0 < cores < tp:
            raise pytest.UsageError(
                f"--port nxdi --target neuron --tp-degree {tp} -n {workers}: each worker's programs run on {tp} "
                f"NeuronCores, and layerparity_cores_per_worker is {cores}: add -o layerparity_cores_per_worker={tp}"
            )

    def _check_torchrun(self, workers: int) -> None:
        if not (self.ranks.torchrun and self.ranks.world_size > 1):
            return
        if workers:
            raise pytest.UsageError(
                f"-n {workers} under torchrun: every rank must run the same tests in the same order (tensor "
                "parallelism runs collectives across ranks), and xdist would split them differently on each "
                "rank; drop -n (torchrun already runs one pytest per rank)"
            )
        if self.settings.gpu_golden:
            raise pytest.UsageError(
                f"--gpu-golden under torchrun (WORLD_SIZE={self.ranks.world_size}): the reference runs in one "
                "process; run pytest --gpu-golden --extract without torchrun (add -n N to spread layers over workers)"
            )

    def _plan_workers(self, workers: int) -> None:
        if self.neuron:
            visible = os.environ.get(NEURON_CORES)
            try:
                check_neuron_core_plan(
                    workers, self.settings.cores_per_worker, parse_core_list(visible) if visible else None
                )
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
            index,
            neuron=self.neuron,
            cores_per_worker=self.settings.cores_per_worker,
            cuda_devices=self.cuda_pool,
        )

    def pytest_report_header(self, config: pytest.Config) -> list[str] | None:
        if not self.active:
            return None
        lines = []
        if self.ranks.torchrun:
            lines.append(
                f"layerparity: torchrun rank {self.ranks.rank} of {self.ranks.world_size} "
                f"(local {self.ranks.local_rank} of {self.ranks.local_world_size}); rank 0 reports, "
                "the other ranks run the same tests quietly"
            )
        cache = self.settings.compile_cache
        if (
            cache and self.settings.mode == RunMode.PARITY and (self.neuron or self.xla)
        ):  # (the session says where unused)
            kind = "NEURON_COMPILE_CACHE_URL" if self.neuron else "torch-xla persistent cache"
            lines.append(f"layerparity: compile cache {cache} ({kind})")
        return lines or None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.failed += 1
        elif report.passed and report.when == "call":
            self.passed += 1

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.quiet and (self.failed or exitstatus not in (0, 5)):
            line = (
                f"layerparity: torchrun rank {self.ranks.rank} of {self.ranks.world_size}: {self.failed} failed, "
                f"{self.passed} passed (exit status {int(exitstatus)}); rank 0's output lists the same tests\n"
            )
            os.write(sys.__stderr__.fileno() if sys.__stderr__ else 2, line.encode())
