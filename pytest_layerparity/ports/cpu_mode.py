"""NxD's CPU mode, the runtime of ``--port nxdi --target cpu``: the port's decoder layer built
as NxDI's ``to_cpu`` builds it, sharded by NxD's ``get_sharded_checkpoint`` over torchrun's
ranks (or one process), and called through :class:`HFCallToNxDI`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .application import decoder_layer_class
from .hf_call import HFCallToNxDI
from .kv_layout import KvLayout
from .model_tags import layer_config, make_layer
from .nxd_common import PortError, PortParts


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


class CpuModeRuntime:
    """The NxDI port's layers in NxD's CPU mode (:class:`CpuMode`, set up when the first layer
    is built), one process per shard at ``tp_degree`` > 1."""

    compiled = None  # no compiled programs: the layers run eagerly

    def __init__(self, tp_degree: int = 1) -> None:
        self.mode = CpuMode(tp_degree)

    @property
    def sharded(self) -> bool:
        return self.mode.tp_degree > 1

    def start(self, port: PortParts) -> None:
        """Nothing to check before the first layer (CPU mode is set up when it is built)."""

    def stop(self) -> None:
        self.mode.teardown()

    def check_dtype(self, dtype: torch.dtype) -> None:
        if dtype == torch.float16:
            raise PortError(
                "--port nxdi --target cpu: NxDI runs float16 only on Neuron (to_cpu refuses it); "
                "use --dtype bfloat16 or float32"
            )

    def placement(self) -> dict[str, Any]:
        """The NeuronConfig's placement fields: ``on_cpu`` at the runtime's tp degree."""
        return {"tp_degree": self.mode.tp_degree, "on_cpu": True}

    def describe(self, port: PortParts) -> str:
        tp = self.mode.tp_degree
        if tp == 1:
            return "NxD CPU mode (gloo, world size 1), no Neuron compile"
        return (
            f"NxD CPU mode, tensor parallelism {tp} over {tp} torchrun ranks (gloo; bfloat16 collectives too, "
            f"which NxDI's to_cpu refuses at tp > 1), {self.kv_heads_text(port, tp)}, no Neuron compile"
        )

    def kv_heads_text(self, port: PortParts, tp: int) -> str:
        """How NxDI shards this model's KV heads at ``tp`` (its own choice of GQA strategy)."""
        from neuronx_distributed_inference.modules.attention.gqa import (
            determine_sharding_strategy,
            get_shardable_head_counts,
        )

        config = port.source().config_json
        text = config.get("text_config") or config
        heads = int(text["num_attention_heads"])
        kv = int(text.get("num_key_value_heads") or heads)
        strategy = determine_sharding_strategy(tp, kv)
        _, total = get_shardable_head_counts(tp, heads, kv, strategy)
        layout = KvLayout(strategy.name, kv, total, 1, tp)
        return f"KV heads: {layout.describe()}"

    def build(self, port: PortParts, index: int, dtype: torch.dtype, batch_size: int, seq_len: int) -> torch.nn.Module:
        """Layer ``index`` as NxDI's ``to_cpu`` loads it, this rank's shard of its weights."""
        self.mode.setup()  # before NxD's trace module is imported, as the port always did
        from neuronx_distributed.trace.trace import get_sharded_checkpoint

        layer_cls = decoder_layer_class(port.app)
        config = layer_config(layer_cls, port.inference_config(dtype, batch_size, seq_len), index)
        layer = make_layer(layer_cls, config, index)
        if dtype == torch.bfloat16:
            layer.bfloat16()  # as to_cpu does
        state = port.layer_state(index, config, dtype)
        tp = self.mode.tp_degree
        try:
            get_sharded_checkpoint(state, layer, self.mode.rank, tp)
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
        return HFCallToNxDI(layer.eval(), index, KvLayout.of(layer, tp), self.mode.rank)
