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

Long because building, loading and calling an NxDI layer follow one application's conventions together.
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

from .compiled import CompiledLayer
from .kv_layout import KvLayout
from .model_tags import layer_config, make_layer

if TYPE_CHECKING:
    from ..model.source import ModelSource
    from .compiled import CompiledPrograms

#: NxDI's application class of each architecture whose decoder layer has been run here
#: against transformers' (NxDI's ``utils.constants.MODEL_TYPES`` lists the same classes).
APPLICATIONS = {
    "llama": "neuronx_distributed_inference.models.llama.modeling_llama:NeuronLlamaForCausalLM",
    "mixtral": "neuronx_distributed_inference.models.mixtral.modeling_mixtral:NeuronMixtralForCausalLM",
    "qwen3_moe": "neuronx_distributed_inference.models.qwen3_moe.modeling_qwen3_moe:NeuronQwen3MoeForCausalLM",
    "qwen2": "neuronx_distributed_inference.models.qwen2.modeling_qwen2:NeuronQwen2ForCausalLM",
    "qwen3": "neuronx_distributed_inference.models.qwen3.modeling_qwen3:NeuronQwen3ForCausalLM",
    "mistral": "neuronx_distributed_inference.models.mistral.modeling_mistral:NeuronMistralForCausalLM",
    # runs, and differs from transformers' Gemma-3 (docs/nxdi-and-trainium.md, "Findings on NxDI's Gemma-3")
    "gemma3": "neuronx_distributed_inference.models.gemma3.modeling_gemma3:NeuronGemma3ForCausalLM",
}


#: NxDI's release decoders that cannot run as a layer port on the CPU, and why
#: (docs/nxdi-and-trainium.md, "NxDI's release decoders"): refused by model_type before any
#: work, unless layerparity_nxdi_app names a class.
NOT_RUNNABLE = {
    "gpt_oss": "NxDI's GPT-OSS layer is built with a rotary cache manager its model owns and called with cos/sin "
    "caches, not a layer the plugin can build alone, and its converter reads the released MXFP4 expert tensors "
    "(*_blocks, *_scales)",
    "dbrx": "NxDI's DBRX layer is NeuronDbrxBlock (block_idx, checkpoint prefix transformer.blocks.N), not a "
    "*DecoderLayer the plugin builds",
    "llama4": "NxDI's Llama 4 module has two decoder layer classes (MoE and dense, chosen per layer by its model) "
    "and its config reads the composite checkpoint's text_config",
    "llama4_text": "NxDI's Llama 4 reads the composite llama4 checkpoint (text_config), and its module has two "
    "decoder layer classes",
    "deepseek_v3": "NxDI's models/deepseek has no application or decoder layer class (a config, an RMSNorm and "
    "the MLA attention only)",
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

    from ..model.build import transformers_4_names

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
        if spec is None and model_type in NOT_RUNNABLE:
            raise PortError(
                f"--port nxdi: {NOT_RUNNABLE[model_type]}; a port of your own of it: "
                "-o layerparity_nxdi_app=package.module:NeuronXForCausalLM"
            )
        if spec is None:
            raise PortError(
                f"--port nxdi: no NxDI application class known for model_type {model_type!r} (known: "
                f"{', '.join(sorted(APPLICATIONS))}); name one with "
                "-o layerparity_nxdi_app=package.module:NeuronXForCausalLM"
            )
    module_name, _, class_name = spec.partition(":")
    if not class_name:
        raise PortError(f"layerparity_nxdi_app = {spec!r}: write it as package.module:ClassName")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PortError(f"--port nxdi: cannot import {module_name} ({exc})") from exc
    app = getattr(module, class_name, None)
    if app is None:
        raise PortError(f"layerparity_nxdi_app = {spec!r}: {module_name} has no {class_name}")
    for needed in ("convert_hf_to_neuron_state_dict", "get_config_cls"):
        if not hasattr(app, needed):
            raise PortError(
                f"layerparity_nxdi_app = {spec!r}: {class_name} has no {needed} (not an NxDI application class?)"
            )
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
    """NxD's CPU mode for one process: what ``setup`` set, so ``teardown`` undoes only that.
    ``tp_degree`` ranks: one process (a world of one), or torchrun's ranks, one per shard."""

    tp_degree: int = 1
    env_applied: dict[str, str] = field(default_factory=dict)
    owns_group: bool = False
    owns_parallel_state: bool = False

    def setup(self) -> None:
        """Idempotent. Under torchrun the gloo group is the launch's (rendezvous from the
        environment torchrun set, as NxDI's ``to_cpu`` makes it); a world of one has an
        in-process store, not a TCP port: it needs no peer, and xdist workers (each its own
        world of one) cannot collide on a port."""
        import torch.distributed as dist

        from ..distributed.env import rank_info

        if os.environ.get("NXD_CPU_MODE") != "1":
            self.env_applied["NXD_CPU_MODE"] = os.environ["NXD_CPU_MODE"] = "1"
        if not dist.is_initialized():
            ranks = rank_info()
            if ranks.torchrun and ranks.world_size > 1:
                dist.init_process_group("gloo")
            else:
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self.owns_group = True
        if dist.get_world_size() != self.tp_degree:
            raise PortError(
                f"--port nxdi --target cpu --tp-degree {self.tp_degree} runs one process per shard (a gloo group of "
                f"world size {self.tp_degree}); this process group has {dist.get_world_size()} ranks"
            )
        from neuronx_distributed.parallel_layers import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                self.tp_degree, 1, expert_model_parallel_size=1, skip_collective_init=True
            )
            self.owns_parallel_state = True

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0

    def teardown(self) -> None:
        import torch.distributed as dist

        from ..backends.neuron import release_distributed

        if self.owns_group and dist.is_initialized() and dist.get_world_size() > 1:
            # every rank leaves together: torchrun stops the others when one exits with a failure,
            # and rank 0, which reports, must not be stopped before it has
            dist.barrier()
        release_distributed(self.owns_parallel_state, self.owns_group, self.env_applied)
        self.owns_parallel_state = self.owns_group = False
        self.env_applied = {}


# -- the port ----------------------------------------------------------------------------------


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
        self.compiled = compiled  # --target neuron: the programs NxDI's builder compiles; else CPU mode
        self.runtime = CpuMode(tp_degree)
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
                "sources (pip install --no-deps <src>) with transformers==4.57.*, as docs/nxdi-and-trainium.md shows"
            ) from exc
        with nxd_warnings_quiet():
            app = import_application(self.source().config_json.get("model_type"), self.app_spec)
        decoder_layer_class(app)  # one the port can build, or a usage error now (not mid-session)
        self._app = app
        if self.compiled is not None:
            self.logical_nc_config()  # an option the environment overrides is a usage error now

    def stop(self) -> None:
        self.runtime.teardown()
        if self.compiled is not None:
            self.compiled.cleanup()

    @property
    def sharded(self) -> bool:
        """Whether the layers run sharded over torchrun ranks (NxD's CPU mode at tp > 1)."""
        return self.compiled is None and self.runtime.tp_degree > 1

    @property
    def app(self) -> type:
        self.start()
        assert self._app is not None
        return self._app

    def describe(self) -> str:
        app = self.app
        layer = decoder_layer_class(app)
        version = _version("neuronx-distributed-inference")
        if self.compiled is not None:
            lnc, origin = self.logical_nc_config()
            runs = self.compiled.describe(f"{lnc} ({origin})")
        else:
            runs = self._describe_cpu_mode()
        text = f"NxDI port {app.__name__} / {layer.__name__} (neuronx-distributed-inference {version}), {runs}"
        if self.stood_in:
            text += f"; stand-ins for the closed-source {', '.join(self.stood_in)}"
        return text

    def _describe_cpu_mode(self) -> str:
        tp = self.runtime.tp_degree
        if tp == 1:
            return "NxD CPU mode (gloo, world size 1), no Neuron compile"
        return (
            f"NxD CPU mode, tensor parallelism {tp} over {tp} torchrun ranks (gloo; bfloat16 collectives too, "
            f"which NxDI's to_cpu refuses at tp > 1), {self.kv_heads_text(tp)}, no Neuron compile"
        )

    def kv_heads_text(self, tp: int) -> str:
        """How NxDI shards this model's KV heads at ``tp`` (its own choice of GQA strategy)."""
        from neuronx_distributed_inference.modules.attention.gqa import (
            determine_sharding_strategy,
            get_shardable_head_counts,
        )

        config = self.source().config_json
        text = config.get("text_config") or config
        heads = int(text["num_attention_heads"])
        kv = int(text.get("num_key_value_heads") or heads)
        strategy = determine_sharding_strategy(tp, kv)
        _, total = get_shardable_head_counts(tp, heads, kv, strategy)
        layout = KvLayout(strategy.name, kv, total, 1, tp)
        return f"KV heads: {layout.describe()}"

    def inference_config(self, dtype: torch.dtype, batch_size: int, seq_len: int) -> Any:
        from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

        if dtype == torch.float16 and self.compiled is None:
            raise PortError(
                "--port nxdi --target cpu: NxDI runs float16 only on Neuron (to_cpu refuses it); "
                "use --dtype bfloat16 or float32"
            )
        config_cls = self.app.get_config_cls()
        neuron_config = self.neuron_config(batch_size=batch_size, seq_len=seq_len, torch_dtype=dtype)
        return config_cls(
            neuron_config, load_config=load_pretrained_config(hf_config=hf_config_for_nxdi(self.source().config_json))
        )

    def neuron_config(self, **fields: Any) -> Any:
        """The application's NeuronConfig for this run's placement (``fields`` besides): in NxD's
        CPU mode ``on_cpu`` at the runtime's tp degree; compiled, ``tp_degree``, the MoE's
        expert parallelism, and ``layerparity_logical_nc_config`` where set (else NxDI's
        NeuronConfig resolves the logical NeuronCore config itself)."""
        if self.compiled is None:
            placement: dict[str, Any] = {"tp_degree": self.runtime.tp_degree, "on_cpu": True}
        else:
            placement = {"tp_degree": self.compiled.tp_degree}
            if self.compiled.logical_nc_config is not None:
                placement["logical_nc_config"] = self.compiled.logical_nc_config
            if self.compiled.ep_degree > 1:
                ep = self.compiled.ep_degree
                placement.update(moe_ep_degree=ep, moe_tp_degree=self.compiled.tp_degree // ep)
        return self.app.get_config_cls().get_neuron_config_cls()(**placement, **fields)

    def logical_nc_config(self) -> tuple[int, str]:
        """The logical NeuronCore config of the compiled programs, as NxDI's NeuronConfig resolves
        it (``models/config.py``, ``_get_lnc``), and where it came from: ``NEURON_LOGICAL_NC_CONFIG``,
        else ``layerparity_logical_nc_config``, else the platform's (``torch_neuronx.utils.
        get_platform_target()``: 2 on trn2 and trn3). A variable and an option that disagree are
        refused (NxDI would quietly take the variable). Where it came from is what the eager
        backend resolves (:func:`..backends.neuron.logical_nc_config`); the value is the
        NeuronConfig's own."""
        from ..backends.base import BackendUnavailable
        from ..backends.neuron import logical_nc_config

        assert self.compiled is not None
        try:
            _, origin = logical_nc_config(self.compiled.logical_nc_config)
        except BackendUnavailable as exc:
            raise PortError(str(exc)) from exc
        with nxd_warnings_quiet():
            return int(self.neuron_config().logical_nc_config), origin

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
            if self.compiled is not None:
                return self._build_compiled(index, dtype, batch_size, seq_len)
            self.runtime.setup()
            return self._build(index, dtype, batch_size, seq_len)

    def _build_compiled(self, index: int, dtype: torch.dtype, batch_size: int, seq_len: int) -> torch.nn.Module:
        compiled = self.compiled
        assert compiled is not None
        layer_cls = decoder_layer_class(self.app)
        config = self.inference_config(dtype, batch_size, seq_len)  # each program's tag makes its own of it
        own = layer_config(layer_cls, config, index)
        layer = CompiledLayer(self.app, layer_cls, config, index, lambda: self.layer_state(index, own, dtype))

        def run(example: tuple[torch.Tensor, ...]) -> Any:
            with nxd_warnings_quiet():
                return compiled.run(layer, example)

        return HFCallToProgram(run, index, kv_length=seq_len, layout=layer.kv_layout)

    def _build(self, index: int, dtype: torch.dtype, batch_size: int, seq_len: int) -> torch.nn.Module:
        from neuronx_distributed.trace.trace import get_sharded_checkpoint

        layer_cls = decoder_layer_class(self.app)
        config = layer_config(layer_cls, self.inference_config(dtype, batch_size, seq_len), index)
        layer = make_layer(layer_cls, config, index)
        if dtype == torch.bfloat16:
            layer.bfloat16()  # as to_cpu does
        state = self.layer_state(index, config, dtype)
        tp = self.runtime.tp_degree
        try:
            get_sharded_checkpoint(state, layer, self.runtime.rank, tp)
        except RuntimeError as exc:
            layout = KvLayout.of(layer, tp)
            if layout is None or layout.strategy != "CONVERT_TO_MHA" or layout.total == layout.source:
                raise
            raise PortError(
                f"layer {index}: NxDI's sharding failed at --tp-degree {tp} ({exc}): {tp} ranks do not divide the "
                f"{layout.source} KV heads, so NxDI converts them to multi-head attention (GQA.CONVERT_TO_MHA), "
                f"replicating each KV head {layout.repeats} times, then pads the replicated K/V projections as if they "
                f"still held {layout.source} heads (modules/attention/gqa.py: maybe_pad_tail with "
                "_src_num_key_value_heads after replicate_kv): a defect of NxDI's, not of the port; use a --tp-degree "
                f"that divides the {layout.source} KV heads or that they divide"
            ) from exc
        missing, unexpected = layer.load_state_dict(state, strict=False)
        # NxD's RankUtil holds arange(tp_degree) from construction; some converters leave it out.
        missing = [k for k in missing if not k.endswith("rank_util.rank")]
        if missing:
            raise PortError(f"layer {index}: {layer_cls.__name__} parameters without a converted weight: {missing}")
        if unexpected:
            raise PortError(f"layer {index}: converted weights {layer_cls.__name__} has no place for: {unexpected}")
        return HFCallToNxDI(layer.eval(), index, KvLayout.of(layer, tp), self.runtime.rank)


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
        from ..store.kv_cache import cached_kv, find_kv_cache

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
        if past is None and present is not None and present[0].shape[-2] < seq:
            present = in_order_of_position(present, position_ids)
        if cache is not None and present is not None:
            cache.update(present[0], present[1], self.index)
        return output

    def call_layer(
        self, hidden_states: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, past: tuple | None
    ) -> tuple[torch.Tensor, tuple | None]:
        """The layer's output and the keys and values it made (None if it made none)."""
        raise NotImplementedError


def in_order_of_position(present: tuple, position_ids: torch.Tensor) -> tuple:
    """The keys and values a sliding-window layer's prompt returned, the last W of its
    positions (fewer than the prompt's), from NxDI's ring layout (``get_last_kv_window``:
    position p in slot p mod W, the slots NxDI's token generation writes) into the positions'
    order, the HF cache's; other entries of ``present`` unchanged."""
    keys = present[0]
    batch, heads, width, dim = keys.shape
    latest = position_ids.amax(dim=1).to(keys.device)  # each sample's last position
    slots = (latest[:, None] - width + 1 + torch.arange(width, device=keys.device)) % width
    index = slots[:, None, :, None].expand(batch, heads, width, dim)
    return (keys.gather(2, index), present[1].gather(2, index), *present[2:])


class HFCallToNxDI(HFCall):
    """The HF call made into NxDI's call of its decoder layer (the submodule ``layer``), on one
    rank of ``layout.tp``: the past keys and values split to this rank's heads, the ones the
    ranks made gathered back into the model's heads."""

    def __init__(self, layer: torch.nn.Module, index: int, layout: KvLayout | None = None, rank: int = 0) -> None:
        super().__init__(index)
        self.layer = layer
        self.layout = layout
        self.rank = rank

    def call_layer(
        self, hidden_states: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, past: tuple | None
    ) -> tuple[torch.Tensor, tuple | None]:
        """NxDI's call: the output and the keys and values the layer made (None if it made none)."""
        layout = self.layout
        if past is not None and layout is not None:
            past = tuple(layout.split(t, self.rank) for t in past)
        outputs = self.layer(hidden_states, attention_mask=mask, position_ids=position_ids, past_key_value=past)
        present = outputs[1] if isinstance(outputs, (tuple, list)) and len(outputs) > 1 else None
        if present is not None and layout is not None:
            present = tuple(layout.gather(t) for t in present[:2])
        return outputs[0], present


class HFCallToProgram(HFCall):
    """The HF call made into the positional call of the layer's compiled program (``run``
    finds the program of the call's shape and calls it); its routers are inside the program.
    A decode step's past comes in a static KV cache of ``kv_length`` positions, as NxDI's
    token-generation model holds it, so that every step has the same shape. Sharded
    (``layout()``: how the program's ranks hold the KV heads; None where nothing shards them),
    the past goes in as the ranks hold it, rank after rank along the heads (each rank's program
    takes its own block, :class:`LayerProgram`), and the keys and values the program returns,
    gathered from every rank, come back as the model's heads."""

    def __init__(
        self,
        run: Callable[[tuple[torch.Tensor, ...]], Any],
        index: int,
        kv_length: int,
        layout: Callable[[], KvLayout | None] = lambda: None,
    ) -> None:
        super().__init__(index)
        self.run = run
        self.kv_length = kv_length
        self.layout = layout

    def call_layer(
        self, hidden_states: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, past: tuple | None
    ) -> tuple[torch.Tensor, tuple | None]:
        layout = self.layout()
        if past is not None:
            mask, past = static_kv_cache(mask, past, self.kv_length)
            if layout is not None:
                past = tuple(layout.by_rank(t) for t in past)
        positions = position_ids.to(torch.int32).contiguous()  # as NxDI's ModelWrapper.input_generator makes them
        example = (hidden_states, mask.contiguous(), positions, *(t.contiguous() for t in past or ()))
        outputs = self.run(example)
        if isinstance(outputs, torch.Tensor):
            return outputs, None
        outputs = tuple(outputs)
        if len(outputs) < 3:
            return outputs[0], None
        present = (outputs[1], outputs[2])
        if layout is not None:
            present = tuple(layout.merge(t) for t in present)
        return outputs[0], present


def static_kv_cache(mask: torch.Tensor, past: tuple, length: int) -> tuple[torch.Tensor, tuple]:
    """A decode step's past keys and values ([batch, heads, positions, dim]) padded with zeros
    to ``length`` positions, and its boolean mask ([batch, 1, 1, positions]) with False there:
    NxDI's token-generation attention gives masked positions the dtype's minimum score, so
    they weigh zero (the new token is attended apart, from its own keys and values)."""
    held = past[0].shape[-2]
    if held >= length:
        raise PortError(
            f"a decode step's past of {held} tokens does not fit the token-generation program's KV cache of "
            f"{length} positions (the goldens' prompt + decode tokens)"
        )
    extra = length - held
    padded = tuple(torch.nn.functional.pad(t, (0, 0, 0, extra)) for t in past)
    room = torch.zeros(*mask.shape[:-1], extra, dtype=torch.bool, device=mask.device)
    return torch.cat([mask.to(torch.bool), room], dim=-1), padded
