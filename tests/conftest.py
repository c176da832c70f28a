"""The project's own tests: ``unit/`` (the modules in this process: no subprocess, no checkpoint
written; seconds) and ``e2e/`` (the plugin as a user runs it, on the embedded model and
torch-xla's CPU device, and what needs a process of its own or a checkpoint written for it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
# torch's idle threads sleep rather than spin (the plugin does the same for its own runs; here the
# tests import torch before any plugin run): see distributed.env.idle_threads_sleep
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_configure(config):
    """Under ``-n N`` each worker, and the pytest processes its tests start, use a share of the
    cores (every process with as many threads as the machine has cores makes each parallel
    region wait on a descheduled thread)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return
    from pytest_layerparity.distributed.env import available_cores, thread_share

    threads = thread_share(available_cores(), int(workerinput.get("workercount", 1)))
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


@pytest.fixture
def mapped_from_a_file():
    """Whether a tensor's memory lies in a file mapping of this process (/proc/self/maps)."""

    def mapped(tensor) -> bool:
        address = tensor.untyped_storage().data_ptr()
        for line in Path("/proc/self/maps").read_text().splitlines():
            span, _, _, _, inode, *_ = [*line.split(), ""]
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= address < high:
                return inode != "0"
        return False

    return mapped
