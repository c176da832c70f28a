"""The runtime of ``--port nxdi --target neuron``: each layer called through the compiled
program of its kind and call shape (:class:`.compiled.CompiledPrograms`), with the placement
(tensor and expert parallelism, logical NeuronCore config) NxDI's NeuronConfig gets from it."""

from __future__ import annotations

from typing import Any

import torch

from .application import decoder_layer_class
from .compiled import CompiledLayer, CompiledPrograms
from .hf_call import HFCallToProgram
from .model_tags import layer_config
from .nxd_common import PortError, PortParts, nxd_warnings_quiet


class CompiledRuntime:
    """The NxDI port's layers in ``compiled``'s programs; ModelBuilder shards them in one
    process, so the port itself is never sharded over ranks."""

    sharded = False

    def __init__(self, compiled: CompiledPrograms) -> None:
        self.compiled = compiled

    def start(self, port: PortParts) -> None:
        self.logical_nc_config(port)  # an option the environment overrides is a usage error now

    def stop(self) -> None:
        self.compiled.cleanup()

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Every dtype runs on Neuron."""

    def placement(self) -> dict[str, Any]:
        """The NeuronConfig's placement fields: ``tp_degree``, the MoE's expert parallelism, and
        ``layerparity_logical_nc_config`` where set (else NxDI's NeuronConfig resolves the
        logical NeuronCore config itself)."""
        compiled = self.compiled
        placement: dict[str, Any] = {"tp_degree": compiled.tp_degree}
        if compiled.logical_nc_config is not None:
            placement["logical_nc_config"] = compiled.logical_nc_config
        if compiled.ep_degree > 1:
            ep = compiled.ep_degree
            placement.update(moe_ep_degree=ep, moe_tp_degree=compiled.tp_degree // ep)
        return placement

    def describe(self, port: PortParts) -> str:
        lnc, origin = self.logical_nc_config(port)
        return self.compiled.describe(f"{lnc} ({origin})")

    def logical_nc_config(self, port: PortParts) -> tuple[int, str]:
        """The logical NeuronCore config of the compiled programs, as NxDI's NeuronConfig resolves
        it (``models/config.py``, ``_get_lnc``), and where it came from: ``NEURON_LOGICAL_NC_CONFIG``,
        else ``layerparity_logical_nc_config``, else the platform's (``torch_neuronx.utils.
        get_platform_target()``: 2 on trn2 and trn3). A variable and an option that disagree are
        refused (NxDI would quietly take the variable). Where it came from is what the eager
        backend resolves (:func:`..backends.neuron.logical_nc_config`); the value is the
        NeuronConfig's own."""
        from ..backends.base import BackendUnavailable
        from ..backends.neuron import logical_nc_config

        try:
            _, origin = logical_nc_config(self.compiled.logical_nc_config)
        except BackendUnavailable as exc:
            raise PortError(str(exc)) from exc
        with nxd_warnings_quiet():
            return int(port.neuron_config().logical_nc_config), origin

    def build(self, port: PortParts, index: int, dtype: torch.dtype, batch_size: int, seq_len: int) -> torch.nn.Module:
        """Layer ``index`` in the compiled program of its kind and call shape, built at the first
        call of the first layer that needs it."""
        compiled = self.compiled
        layer_cls = decoder_layer_class(port.app)
        config = port.inference_config(dtype, batch_size, seq_len)  # each program's tag makes its own of it
        own = layer_config(layer_cls, config, index)
        layer = CompiledLayer(port.app, layer_cls, config, index, lambda: port.layer_state(index, own, dtype))

        def run(example: tuple[torch.Tensor, ...]) -> Any:
            with nxd_warnings_quiet():
                return compiled.run(layer, example)

        return HFCallToProgram(run, index, kv_length=seq_len, layout=layer.kv_layout)
