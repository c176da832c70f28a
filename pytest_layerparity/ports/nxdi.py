"""The NxDI port of a decoder layer, built the way neuronx-distributed-inference builds it,
and run on the CPU in NxD's CPU mode.

For layer N, as NxDI's application class loads a model on the CPU (``NeuronApplicationBase.
to_cpu`` and ``get_state_dict``): the checkpoint's tensors of layer N (under the checkpoint's
own names, ``model.`` stripped), cast to the dtype, through the application class's
``convert_hf_to_neuron_state_dict`` (run on a one-layer copy of the config, so that its
per-layer loops see only this layer), then neuronx-distributed's ``get_sharded_checkpoint``
(its pre-shard hooks rename e.g. ``q_proj`` to ``qkv_proj.q_proj``) into the port's decoder
layer class, built from the application's ``InferenceConfig`` with ``NeuronConfig(on_cpu=True)``.

The runtime is NxD's CPU mode: ``NXD_CPU_MODE=1``, a gloo process group of world size 1 and
``parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1,
skip_collective_init=True)``, set up once per session (what NxDI's ``to_cpu`` does).

The golden call is HuggingFace's (hidden states, mask, position ids, a KV cache in decode
steps); :class:`HFCallToNxDI` makes NxDI's call of it: a boolean mask (``(B, 1, S, S)`` causal
in the prompt pass, ``(B, 1, 1, S_past)`` in a decode step), the position ids (NxDI computes
its own rotary embedding from them, so the port's RoPE is under test too), and in a decode
step ``past_key_value=(keys, values)``; the keys and values NxDI returns are appended to the
cache it was given, where the decode-step test reads them.

Under ``--target neuron`` the same layer runs in a compiled program instead, one per layer kind
and call shape (``ports/compiled.py``), and :class:`HFCallToProgram` makes the program's
positional call of the HF call, a decode step's past in a static KV cache.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .application import (
    APPLICATIONS,
    NOT_RUNNABLE,
    decoder_layer_class,
    hf_config_for_nxdi,
    import_application,
)
from .compiled_runtime import CompiledRuntime
from .cpu_mode import CpuMode, CpuModeRuntime
from .hf_call import HFCall, HFCallToNxDI, HFCallToProgram, in_order_of_position, static_kv_cache
from .model_tags import layer_config
from .nxd_common import PortError, PortParts, nxd_warnings_quiet

if TYPE_CHECKING:
    from ..model.source import ModelSource
    from .compiled import CompiledPrograms

# The port's names, wherever they are defined, are imported from this module.
__all__ = [
    "APPLICATIONS",
    "NOT_RUNNABLE",
    "CpuMode",
    "HFCall",
    "HFCallToNxDI",
    "HFCallToProgram",
    "NxdiPort",
    "PortError",
    "decoder_layer_class",
    "hf_config_for_nxdi",
    "import_application",
    "in_order_of_position",
    "layer_config",
    "nxd_warnings_quiet",
    "static_kv_cache",
]


class Runtime(Protocol):
    """Where the port's layers run, chosen once: NxD's CPU mode (:class:`.cpu_mode.CpuModeRuntime`)
    or NxDI's compiled programs (:class:`.compiled_runtime.CompiledRuntime`)."""

    compiled: CompiledPrograms | None  # the programs under --target neuron, else None

    @property
    def sharded(self) -> bool: ...

    def start(self, port: PortParts) -> None: ...

    def stop(self) -> None: ...

    def check_dtype(self, dtype: torch.dtype) -> None: ...

    def placement(self) -> dict[str, Any]: ...

    def describe(self, port: PortParts) -> str: ...

    def build(
        self, port: PortParts, index: int, dtype: torch.dtype, batch_size: int, seq_len: int
    ) -> torch.nn.Module: ...


class NxdiPort:
    """Builds layer N of the NxDI port of one checkpoint, for one (batch, sequence) shape."""

    def __init__(
        self,
        source: Callable[[], ModelSource],
        app_spec: str | None = None,
        compiled: CompiledPrograms | None = None,
        tp_degree: int = 1,
    ) -> None:
        self.source = source  # the session's model folder, read when first needed
        self.app_spec = app_spec
        # --target neuron: the programs NxDI's builder compiles; else NxD's CPU mode
        self.runtime: Runtime = CpuModeRuntime(tp_degree) if compiled is None else CompiledRuntime(compiled)
        self.stood_in: list[str] = []
        self._app: type | None = None

    @property
    def compiled(self) -> CompiledPrograms | None:
        """The compiled programs the layers run in (None in NxD's CPU mode)."""
        return self.runtime.compiled

    def start(self) -> None:
        """Stand in for the absent closed-source packages and import the port (CPU mode is set
        up when the first layer is built: an xdist controller builds none)."""
        if self._app is not None:
            return
        from . import standins

        self.stood_in = standins.install()
        try:
            with nxd_warnings_quiet():
                import neuronx_distributed_inference  # noqa: F401
        except ImportError as exc:
            raise PortError(
                f"--port nxdi: neuronx-distributed-inference does not import ({exc}); install NxD and NxDI from their "
                "sources (pip install --no-deps <src>) with transformers==4.57.*, as docs/nxdi-and-trainium.md shows"
            ) from exc
        with nxd_warnings_quiet():
            app = import_application(self.source().config_json.get("model_type"), self.app_spec)
        decoder_layer_class(app)  # one the port can build, or a usage error now (not mid-session)
        self._app = app
        self.runtime.start(self)

    def stop(self) -> None:
        self.runtime.stop()

    @property
    def sharded(self) -> bool:
        """Whether the layers run sharded over torchrun ranks (NxD's CPU mode at tp > 1)."""
        return self.runtime.sharded

    @property
    def app(self) -> type:
        self.start()
        assert self._app is not None
        return self._app

    def describe(self) -> str:
        app = self.app
        layer = decoder_layer_class(app)
        version = _version("neuronx-distributed-inference")
        runs = self.runtime.describe(self)
        text = f"NxDI port {app.__name__} / {layer.__name__} (neuronx-distributed-inference {version}), {runs}"
        if self.stood_in:
            text += f"; stand-ins for the closed-source {', '.join(self.stood_in)}"
        return text

    def inference_config(self, dtype: torch.dtype, batch_size: int, seq_len: int) -> Any:
        from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

        self.runtime.check_dtype(dtype)
        config_cls = self.app.get_config_cls()
        neuron_config = self.neuron_config(batch_size=batch_size, seq_len=seq_len, torch_dtype=dtype)
        return config_cls(
            neuron_config, load_config=load_pretrained_config(hf_config=hf_config_for_nxdi(self.source().config_json))
        )

    def neuron_config(self, **fields: Any) -> Any:
        """The application's NeuronConfig for this run's placement (the runtime's: ``on_cpu`` in
        NxD's CPU mode; tensor and expert parallelism and the logical NeuronCore config where
        compiled), ``fields`` besides."""
        return self.app.get_config_cls().get_neuron_config_cls()(**self.runtime.placement(), **fields)

    def layer_state(self, index: int, config: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Layer ``index``'s checkpoint tensors through the application's converter, named
        relative to the decoder layer."""
        checkpoint = self.source().checkpoint
        app = self.app
        old = getattr(app, "_STATE_DICT_MODEL_PREFIX", "model.")
        new = getattr(app, "_NEW_STATE_DICT_MODEL_PREFIX", "")
        prefix = f"{old}layers.{index}."
        keys = [k for k in checkpoint.weight_map if k.startswith(prefix)]
        if not keys:
            raise PortError(f"{checkpoint.root}: no checkpoint tensors under {prefix!r} for layer {index}")
        state = {}
        for key, tensor in checkpoint.read(keys).items():
            name = f"{new}layers.0." + key[len(prefix) :]
            state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        one_layer = copy.copy(config)
        one_layer.num_hidden_layers = 1
        beside: dict[str, torch.Tensor] = {}  # model-level tensors the converter reads (Gemma-3's final norm)
        while True:
            try:  # on fresh copies: converters change tensors in place
                given = {k: v.clone() for k, v in {**state, **beside}.items()}
                converted = app.convert_hf_to_neuron_state_dict(given, one_layer)
                break
            except KeyError as exc:
                name = exc.args[0] if exc.args else None
                if not isinstance(name, str) or name in beside or f"{old}{name}" not in checkpoint.weight_map:
                    raise PortError(
                        f"layer {index}: {app.__name__}.convert_hf_to_neuron_state_dict needs {exc} beside the layer's "
                        "own tensors"
                    ) from exc
                tensor = checkpoint.read([f"{old}{name}"])[f"{old}{name}"]
                beside[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        lead = f"{new}layers.0."
        return {k[len(lead) :]: v for k, v in converted.items() if k.startswith(lead)}

    def build(self, index: int, dtype: torch.dtype, batch_size: int, seq_len: int) -> torch.nn.Module:
        """Layer ``index`` of the port, weights loaded, in eval mode, wrapped to take the
        HuggingFace layer's call (under --target neuron: in the compiled program of its kind and
        call shape, built at the first call of the first layer that needs it)."""
        with nxd_warnings_quiet():
            return self.runtime.build(self, index, dtype, batch_size, seq_len)


def _version(dist_name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return "from source"
