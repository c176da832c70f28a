"""AWS Trainium / Inferentia through torch-neuronx and neuronx-distributed.

Neuron modeling code builds only inside an initialised distributed environment, which may
be initialised once per process: ``setup()`` does it once per session, respecting what
torchrun (or anything else) already set up, and ``teardown()`` undoes what it did.
"""
from __future__ import annotations

import os
from typing import Any

from .base import Backend

DEFAULT_ENV = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "12355"}


def apply_env_defaults(environ: dict[str, str] | Any = os.environ) -> dict[str, str]:
    """Set RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT where unset (torchrun's values win).
    Returns the variables that were set here."""
    applied = {}
    for key, value in DEFAULT_ENV.items():
        if key not in environ:
            environ[key] = value
            applied[key] = value
    return applied


class NeuronBackend(Backend):
    name = "neuron"
    lazy = True

    def __init__(self, tp_degree: int = 1) -> None:
        self.tp_degree = tp_degree
        self._device = None
        self._we_initialised_pg = False
        self._we_initialised_mp = False

    def setup(self) -> None:
        import torch
        import torch_xla

        apply_env_defaults()
        if not torch.distributed.is_initialized():
            import torch_xla.distributed.xla_backend  # noqa: F401  registers the "xla" backend

            torch.distributed.init_process_group("xla")
            self._we_initialised_pg = True
        from neuronx_distributed.parallel_layers import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=self.tp_degree)
            self._we_initialised_mp = True
        self._device = torch_xla.device()

    def teardown(self) -> None:
        import torch

        if self._we_initialised_mp:
            from neuronx_distributed.parallel_layers import parallel_state

            parallel_state.destroy_model_parallel()
            self._we_initialised_mp = False
        if self._we_initialised_pg and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            self._we_initialised_pg = False

    @property
    def device(self) -> Any:
        if self._device is None:
            self.setup()
        return self._device

    def sync(self) -> None:
        import torch_xla

        torch_xla.sync()

    def describe(self) -> str:
        return f"neuron {self._device} (tp_degree={self.tp_degree}, RANK={os.environ.get('RANK')}, WORLD_SIZE={os.environ.get('WORLD_SIZE')})"
