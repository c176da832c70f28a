from __future__ import annotations

import os
from pathlib import Path

from .base import BackendUnavailable
from .torch_xla_device import TorchXlaBackend

CACHE_COUNTERS = ("PersistentCacheHit", "PersistentCacheMiss", "PersistentCacheDeserializeFailure")


def start_persistent_cache(path: str) -> None:
    """Switch on torch-xla's persistent compilation cache at ``path``
    (``torch_xla.runtime.initialize_cache``), which must come before the process compiles
    anything; say so when it is too late rather than fail on torch-xla's assertion."""
    import torch_xla
    import torch_xla.runtime as xr

    Path(path).mkdir(parents=True, exist_ok=True)
    if torch_xla._XLAC._xla_computation_cache_is_initialized():
        if os.environ.get("XLA_PERSISTENT_CACHE_PATH") == path:
            return
        raise BackendUnavailable(
            f"--compile-cache {path}: this process ran XLA computations before the session set up its device, "
            "so torch-xla's persistent cache can no longer be switched on (torch_xla.runtime.initialize_cache must "
            f"come first); start pytest in a fresh process, or set XLA_PERSISTENT_CACHE_PATH={path} in its environment"
        )
    xr.initialize_cache(path, readonly=False)


def cache_counters() -> dict[str, int]:
    """torch-xla's persistent-cache counters in this process (hits, misses, executables that
    were found on disk but could not be loaded)."""
    import torch_xla.debug.metrics as met

    return {name: int(met.counter_value(name) or 0) for name in CACHE_COUNTERS}


class XlaBackend(TorchXlaBackend):
    """Any torch-xla device (CPU with PJRT_DEVICE=CPU, TPU, Neuron through its PJRT plugin)."""

    name = "xla"
    #: PJRT devices whose float16 dots sum in float32 (TPUs' and Neuron's matrix units, XLA's
    #: GPU backend through cuBLAS); XLA's CPU backend sums them in float16 (bench/README.md),
    #: and a device not named here is taken to be able to.
    FLOAT32_SUMS_DEVICES = frozenset({"TPU", "NEURON", "CUDA", "GPU"})

    @property
    def sixteen_bit_sums(self) -> bool:  # type: ignore[override]
        return os.environ.get("PJRT_DEVICE", "CPU").upper() not in self.FLOAT32_SUMS_DEVICES

    def __init__(self, compile_cache: str | None = None) -> None:
        self._device = None
        self.compile_cache = compile_cache

    @classmethod
    def free_memory(cls) -> int | None:
        """torch-xla's CPU device is the host's memory; another PJRT device's is not known
        before it is set up."""
        if os.environ.get("PJRT_DEVICE", "CPU") != "CPU":
            return None
        from ..model.devices import free_memory

        return free_memory()["cpu"]

    def setup(self) -> None:
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        import torch_xla

        if self.compile_cache:
            start_persistent_cache(self.compile_cache)
        self._device = torch_xla.device()

    def cache_summary(self) -> str | None:
        """One line on the persistent cache's use in this process, or None without a cache."""
        if not self.compile_cache:
            return None
        counts = cache_counters()
        line = (
            f"compile cache {self.compile_cache}: {counts['PersistentCacheHit']} graphs loaded, "
            f"{counts['PersistentCacheMiss']} compiled and stored"
        )
        failures = counts["PersistentCacheDeserializeFailure"]
        if failures:
            line += (
                f", {failures} found but not loadable (this PJRT client cannot deserialize executables, "
                "e.g. torch-xla 2.9 on CPU: they were compiled again)"
            )
        return line

    def describe(self) -> str:
        import torch_xla

        text = f"{self.device} (torch-xla {torch_xla.__version__}, PJRT_DEVICE={os.environ.get('PJRT_DEVICE')}"
        if self.compile_cache:
            text += f", compile cache {self.compile_cache}"
        return text + ")"
