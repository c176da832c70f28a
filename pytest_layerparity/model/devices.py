"""What the reference side can run on: each visible device's free memory, and the golden
device ``--golden-device`` names."""

from __future__ import annotations

import os
from pathlib import Path


def free_memory() -> dict[str, int]:
    """Free memory per visible device: 'cpu' (MemAvailable) and 'cuda:N'."""
    out = {"cpu": _host_available()}
    try:
        import torch

        for i in range(torch.cuda.device_count()):
            free, _ = torch.cuda.mem_get_info(i)
            out[f"cuda:{i}"] = int(free)
    except Exception:
        pass
    return out


def _host_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_golden_device(choice: str) -> str:
    """``--golden-device``: ``auto`` is CUDA when visible, else the CPU."""
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
