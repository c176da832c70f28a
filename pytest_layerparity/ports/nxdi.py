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

Under ``--target neuron`` the same layer is compiled instead (``ports/compiled.py``), and
:class:`HFCallToProgram` makes the compiled program's positional call of the HF call.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .compiled import make_layer

if TYPE_CHECKING:
    from ..reference.model import ModelSource
    from .compiled import CompiledPrograms

#: NxDI's application class of each architecture whose decoder layer has been run here
#: against transformers' (NxDI's ``utils.constants.MODEL_TYPES`` lists the same classes).
APPLICATIONS = {
    "llama": "neuronx_distributed_inference.models.llama.modeling_llama:NeuronLlamaForCausalLM",
    "mixtral": "neuronx_distributed_inference.models.mixtral.modeling_mixtral:NeuronMixtralForCausalLM",
    "qwen3_moe": "neuronx_distributed_inference.models.qwen3_moe.modeling_qwen3_moe:NeuronQwen3MoeForCausalLM",
}


class PortError(Exception):
    """The NxDI port cannot be built as asked; the message names the fix."""


@contextmanager
def nxd_warnings_quiet() -> Iterator[None]:
    """NxD and NxDI's own deprecation notices (about their use of torch and of each other)
    are theirs to fix, not the port's: kept from a project's ``filterwarnings = error``."""
    with warnings.catch_warnings():
        for category in (DeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category, module=r"neuronx_distributed")
        warnings.filterwarnings("ignore", message="Removing redundant keys from checkpoint")
        yield


# -- the config ------------------------------------------------------------------------------


def hf_config_for_nxdi(config_json: dict[str, Any]) -> Any:
    """The HuggingFace config NxDI's ``load_pretrained_config`` reads, made from config.json
    under the transformers installed with NxDI (4.57), with the fields transformers 5 renamed
    under their old names too (:func:`transformers_4_names`). An architecture that
    transformers does not know becomes a plain ``PretrainedConfig`` of the file's fields (no
    modeling class is imported)."""
    from transformers import AutoConfig, PretrainedConfig

    from ..reference.model import transformers_4_names

    fields = {**config_json, **transformers_4_names(config_json)}
    model_type = fields.pop("model_type", None)
    fields.pop("transformers_version", None)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError):
        config = PretrainedConfig(**fields)
        config.model_type = model_type
        return config


# -- the application class ---------------------------------------------------------------------


def import_application(model_type: str | None, spec: str | None = None) -> type:
    """The NxDI application class: ``spec`` (``module:Class``) when given, else NxDI's class
    for ``model_type``."""
    if spec is None:
        spec = APPLICATIONS.get(model_type or "")
        if spec is None:
            raise PortError(
                f"--port nxdi: no NxDI application class known for model_type {model_type!r} (known: "
                f"{', '.join(sorted(APPLICATIONS))}); name one with --nxdi-app=package.module:NeuronXForCausalLM"
            )
    module_name, _, class_name = spec.partition(":")
    if not class_name:
        raise PortError(f"--nxdi-app {spec!r}: write it as package.module:ClassName")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PortError(f"--port nxdi: cannot import {module_name} ({exc})") from exc
    app = getattr(module, class_name, None)
    if app is None:
        raise PortError(f"--nxdi-app {spec!r}: {module_name} has no {class_name}")
    for needed in ("convert_hf_to_neuron_state_dict", "get_config_cls"):
        if not hasattr(app, needed):
            raise PortError(f"--nxdi-app {spec!r}: {class_name} has no {needed} (not an NxDI application class?)")
    return app


def decoder_layer_class(app: type) -> type:
    """The decoder layer class of an application class: the ``*DecoderLayer`` module class
    its model class instantiates (looked up in the model class's module)."""
    model_cls = getattr(app, "_model_cls", None)
    modules = [inspect.getmodule(c) for c in (model_cls, app) if c is not None]
    found = []
    for module in modules:
        for name, obj in vars(module).items():
            if (
                isinstance(obj, type)
                and issubclass(obj, torch.nn.Module)
                and name.endswith("DecoderLayer")
                and obj.__module__ == module.__name__
            ):
                found.append(obj)
        if found:
            break
    if len(found) != 1:
        names = ", ".join(c.__name__ for c in found) or "none"
        raise PortError(
            f"{app.__name__}: expected one *DecoderLayer class in "
            f"{modules[0].__name__ if modules else '?'}, found {names}"
        )
    return found[0]


# -- the runtime ---------------------------------------------------------------------------------


@dataclass
class CpuMode:
    """NxD's CPU mode for one process: what ``setup`` set, so ``teardown`` undoes only that."""

    env_applied: dict[str, str] = field(default_factory=dict)
    owns_group: bool = False
    owns_parallel_state: bool = False

    def setup(self) -> None:
        """Idempotent. The group's rendezvous is an in-process store, not a TCP port: a world of
        one needs no peer, and xdist workers (each its own world of one) cannot collide on a port."""
        import torch.distributed as dist

        if os.environ.get("NXD_CPU_MODE") != "1":
            self.env_applied["NXD_CPU_MODE"] = os.environ["NXD_CPU_MODE"] = "1"
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self.owns_group = True
        if dist.get_world_size() != 1:
            raise PortError(
                f"--port nxdi --target cpu runs in one process (a gloo group of world size 1); this process group "
                f"has {dist.get_world_size()} ranks"
            )
        from neuronx_distributed.parallel_layers import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1, skip_collective_init=True)
            self.owns_parallel_state = True

    def teardown(self) -> None:
        from ..backends.neuron import release_distributed

        release_distributed(self.owns_parallel_state, self.owns_group, self.env_applied)
        self.owns_parallel_state = self.owns_group = False
        self.env_applied = {}


# -- the port ----------------------------------------------------------------------------------


class NxdiPort:
    """Builds layer N of the NxDI port of one checkpoint, for one (batch, sequence) shape."""

    def __init__(
        self, source: Callable[[], ModelSource], app_spec: str | None = None, compiled: CompiledPrograms | None = None
    ) -> None:
        self.source = source  # the session's model folder, read when first needed
        self.app_spec = app_spec
        self.compiled = compiled  # --target neuron: the programs NxDI's builder compiles; else CPU mode
        self.runtime = CpuMode()
        self.stood_in: list[str] = []
        self._app: type | None = None

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
                "sources (pip install --no-deps <src>) with transformers==4.57.*, as README 'NxDI ports' shows"
            ) from exc
        with nxd_warnings_quiet():
            self._app = import_application(self.source().config_json.get("model_type"), self.app_spec)

    def stop(self) -> None:
        self.runtime.teardown()
        if self.compiled is not None:
            self.compiled.cleanup()

    @property
    def app(self) -> type:
        self.start()
        assert self._app is not None
        return self._app

    def describe(self) -> str:
        app = self.app
        layer = decoder_layer_class(app)
        version = _version("neuronx-distributed-inference")
        runs = (
            "NxD CPU mode (gloo, world size 1), no Neuron compile"
            if self.compiled is None
            else self.compiled.describe()
        )
        text = f"NxDI port {app.__name__} / {layer.__name__} (neuronx-distributed-inference {version}), {runs}"
        if self.stood_in:
            text += f"; stand-ins for the closed-source {', '.join(self.stood_in)}"
        return text

    def inference_config(self, dtype: torch.dtype, batch_size: int, seq_len: int) -> Any:
        from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

        if dtype == torch.float16 and self.compiled is None:
            raise PortError(
                "--port nxdi --target cpu: NxDI runs float16 only on Neuron (to_cpu refuses it); "
                "use --dtype bfloat16 or float32"
            )
        config_cls = self.app.get_config_cls()
        if self.compiled is None:
            placement: dict[str, Any] = {"tp_degree": 1, "on_cpu": True}
        else:
            placement = {"tp_degree": self.compiled.tp_degree}
            if self.compiled.logical_nc_config is not None:
                placement["logical_nc_config"] = self.compiled.logical_nc_config
        neuron_config = config_cls.get_neuron_config_cls()(
            batch_size=batch_size, seq_len=seq_len, torch_dtype=dtype, **placement
        )
        return config_cls(
            neuron_config, load_config=load_pretrained_config(hf_config=hf_config_for_nxdi(self.source().config_json))
        )

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
        try:
            converted = app.convert_hf_to_neuron_state_dict(state, one_layer)
        except KeyError as exc:
            raise PortError(
                f"layer {index}: {app.__name__}.convert_hf_to_neuron_state_dict needs {exc} beside the layer's own "
                "tensors"
            ) from exc
        lead = f"{new}layers.0."
        return {k[len(lead) :]: v for k, v in converted.items() if k.startswith(lead)}

    def build(self, index: int, dtype: torch.dtype, batch_size: int, seq_len: int) -> torch.nn.Module:
        """Layer ``index`` of the port, weights loaded, in eval mode, wrapped to take the
        HuggingFace layer's call (under --target neuron: compiled for each call shape at its first call)."""
        with nxd_warnings_quiet():
            if self.compiled is not None:
                return self._build_compiled(index, dtype, batch_size, seq_len)
            self.runtime.setup()
            return self._build(index, dtype, batch_size, seq_len)

    def _build_compiled(self, index: int, dtype: torch.dtype, batch_size: int, seq_len: int) -> torch.nn.Module:
        compiled = self.compiled
        assert compiled is not None
        config = self.inference_config(dtype, batch_size, seq_len)
        layer_cls = decoder_layer_class(self.app)
        programs: dict[tuple, Callable[..., Any]] = {}

        def program_for(example: tuple[torch.Tensor, ...]) -> Callable[..., Any]:
            key = tuple((tuple(t.shape), t.dtype) for t in example)
            if key not in programs:
                with nxd_warnings_quiet():
                    programs[key] = compiled.build(
                        self.app, layer_cls, config, index, lambda: self.layer_state(index, config, dtype), example
                    )
            return programs[key]

        return HFCallToProgram(program_for, index)

    def _build(self, index: int, dtype: torch.dtype, batch_size: int, seq_len: int) -> torch.nn.Module:
        from neuronx_distributed.trace.trace import get_sharded_checkpoint

        config = self.inference_config(dtype, batch_size, seq_len)
        layer_cls = decoder_layer_class(self.app)
        layer = make_layer(layer_cls, config, index)
        if dtype == torch.bfloat16:
            layer.bfloat16()  # as to_cpu does
        state = self.layer_state(index, config, dtype)
        get_sharded_checkpoint(state, layer, 0, 1)
        missing, unexpected = layer.load_state_dict(state, strict=False)
        # NxD's RankUtil holds arange(tp_degree) from construction; some converters leave it out.
        missing = [k for k in missing if not k.endswith("rank_util.rank")]
        if missing:
            raise PortError(f"layer {index}: {layer_cls.__name__} parameters without a converted weight: {missing}")
        if unexpected:
            raise PortError(f"layer {index}: converted weights {layer_cls.__name__} has no place for: {unexpected}")
        return HFCallToNxDI(layer.eval(), index)


def _version(dist_name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return "from source"


# -- the call ------------------------------------------------------------------------------------


class HFCall(torch.nn.Module):
    """Takes a HuggingFace decoder layer's call (layer ``index`` of the model) and makes the
    call NxDI's layers take: a boolean mask, position ids, the past keys and values of this
    layer from the HF cache; ``call_layer`` (a subclass's) makes the call itself."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        with nxd_warnings_quiet():
            return self._forward(hidden_states, *args, **kwargs)

    def _forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        from ..store.callspec import cached_kv, find_kv_cache

        batch, seq, _ = hidden_states.shape
        device = hidden_states.device
        cache = find_kv_cache([args, kwargs])
        past = cached_kv(cache, self.index) if cache is not None else None
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            start = past[0].shape[-2] if past is not None else 0
            position_ids = torch.arange(start, start + seq, device=device)[None].expand(batch, seq)
        mask = kwargs.get("attention_mask")
        given = None  # HF's 4-D mask as NxDI's boolean one (True where attended; additive: 0 there)
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:
            given = mask if mask.dtype == torch.bool else mask == 0
        if past is None:
            if given is not None:
                allowed = given[..., -seq:].expand(batch, 1, seq, seq)
            else:
                allowed = (
                    torch.ones(seq, seq, dtype=torch.bool, device=device).tril()[None, None].expand(batch, 1, seq, seq)
                )
        else:
            length = past[0].shape[-2]  # NxDI's decode mask covers the past only (the new token is attended apart)
            if given is not None:
                allowed = given[..., -1:, :length].expand(batch, 1, 1, length)
            else:
                allowed = torch.ones(batch, 1, 1, length, dtype=torch.bool, device=device)
        output, present = self.call_layer(hidden_states, allowed, position_ids, past)
        if cache is not None and present is not None:
            cache.update(present[0], present[1], self.index)
        return output

    def call_layer(
        self, hidden_states: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, past: tuple | None
    ) -> tuple[torch.Tensor, tuple | None]:
        """The layer's output and the keys and values it made (None if it made none)."""
        raise NotImplementedError


class HFCallToNxDI(HFCall):
    """The HF call made into NxDI's call of its decoder layer (the submodule ``layer``)."""

    def __init__(self, layer: torch.nn.Module, index: int) -> None:
        super().__init__(index)
        self.layer = layer

    def call_layer(
        self, hidden_states: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, past: tuple | None
    ) -> tuple[torch.Tensor, tuple | None]:
        """NxDI's call: the output and the keys and values the layer made (None if it made none)."""
        outputs = self.layer(hidden_states, attention_mask=mask, position_ids=position_ids, past_key_value=past)
        present = outputs[1] if isinstance(outputs, (tuple, list)) and len(outputs) > 1 else None
        return outputs[0], present


class HFCallToProgram(HFCall):
    """The HF call made into the positional call of the layer's compiled program (one program
    per call shape, from ``program_for(example)``); its routers are inside the program."""

    def __init__(self, program_for: Callable[[tuple[torch.Tensor, ...]], Callable[..., Any]], index: int) -> None:
        super().__init__(index)
        self.program_for = program_for

    def call_layer(
        self, hidden_states: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, past: tuple | None
    ) -> tuple[torch.Tensor, tuple | None]:
        example = (hidden_states, mask.contiguous(), position_ids.contiguous(), *(t.contiguous() for t in past or ()))
        outputs = self.program_for(example)(*example)
        if isinstance(outputs, torch.Tensor):
            return outputs, None
        outputs = tuple(outputs)
        return outputs[0], (outputs[1], outputs[2]) if len(outputs) >= 3 else None
