"""What is compiled for one decoder layer of the NxDI port under ``--target neuron``
(:class:`LayerProgram`: positional tensors in and out, each rank's block of KV heads), the
checkpoint it is built with, what makes two programs differ besides their weights, and the
records of a built program. ``compiled.py`` builds, caches and loads the programs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .model_tags import make_layer


class ProcessGroupLeftBehind(RuntimeError):
    """The builder returned with a process group or parallel_state still set up."""


#: The program's own rank module (NxD's ``SPMDRank``) and its checkpoint entry.
KV_RANK = "kv_rank"


class LayerProgram(torch.nn.Module):
    """What is compiled for a layer: NxDI's decoder layer taking positional tensors (hidden
    states, boolean mask, position ids, and in a decode step the past keys and values) and
    returning tensors (its output, then the keys and values it made).

    Every rank of a program gets the same inputs (SPMD) and the caller gets rank 0's outputs,
    while NxDI's attention holds and makes only its rank's KV heads. At ``tp_degree`` > 1 the
    past therefore comes with every rank's heads, rank after rank, and each rank takes its own
    block by its rank (NxD's ``SPMDRank``, whose weight is ``arange(tp_degree)`` sharded, one
    value per rank: :func:`program_state`), as NxDI's token generation holds a cache per rank;
    the keys and values the layer made are gathered from every rank before they are returned."""

    def __init__(self, layer_cls: type, config: Any, index: int) -> None:
        super().__init__()
        self.layer = make_layer(layer_cls, config, index).eval()
        dtype = config.neuron_config.torch_dtype
        if dtype != torch.float32:
            self.layer.to(dtype)  # as NxDI's get_trace_callable does
        self.tp_degree = int(config.neuron_config.tp_degree)
        if self.tp_degree > 1:
            from neuronx_distributed.parallel_layers.layers import SPMDRank

            setattr(self, KV_RANK, SPMDRank(self.tp_degree))

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        outputs = self.layer(
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_value=tuple(self.own_heads(t) for t in past) if past else None,
        )
        if not isinstance(outputs, (tuple, list)):
            return (outputs,)
        present = outputs[1] if len(outputs) > 1 else None
        if isinstance(present, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in present):
            return (outputs[0], *(self.every_rank(t) for t in present))
        return (outputs[0],)

    def own_heads(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's block of heads of a [batch, heads of every rank, positions, dim] tensor."""
        if self.tp_degree == 1:
            return tensor
        per_rank = tensor.shape[1] // self.tp_degree
        rank = getattr(self, KV_RANK).get_rank().to(torch.int64)
        heads = rank * per_rank + torch.arange(per_rank, device=tensor.device)
        return torch.index_select(tensor, 1, heads)

    def every_rank(self, tensor: torch.Tensor) -> torch.Tensor:
        """A [batch, this rank's heads, positions, dim] tensor gathered over the ranks."""
        if self.tp_degree == 1:
            return tensor
        from neuronx_distributed.parallel_layers.mappings import gather_from_tensor_model_parallel_region_with_dim

        return gather_from_tensor_model_parallel_region_with_dim(tensor, gather_dim=1)


def program_state(layer_state: dict[str, torch.Tensor], tp_degree: int) -> dict[str, torch.Tensor]:
    """A layer's converted state under its :class:`LayerProgram`'s names, with the program's
    rank weight at ``tp_degree`` > 1 (``arange``, as NxDI's converters write ``rank_util.rank``)."""
    state = {f"layer.{k}": v for k, v in layer_state.items()}
    if tp_degree > 1:
        state[f"{KV_RANK}.rank"] = torch.arange(tp_degree, dtype=torch.int32)
    return state


def check_nothing_left() -> None:
    """The builder must leave no process group or parallel_state behind (ModelBuilder destroys
    what it set up for the trace; a builder that does not would break the next build)."""
    import torch.distributed as dist

    left = []
    if dist.is_available() and dist.is_initialized():
        left.append(f"a {dist.get_backend()} process group")
    from neuronx_distributed.parallel_layers import parallel_state

    if parallel_state.model_parallel_is_initialized():
        left.append("neuronx-distributed's parallel_state")
    if left:
        raise ProcessGroupLeftBehind(
            f"the builder left {' and '.join(left)} set up after compiling; NxDI's ModelBuilder sets up and destroys "
            "its own for each trace, so the next build would fail: destroy them in the builder"
        )


#: Module attributes that make two layers' programs differ when they differ (plain values: the
#: module's own settings, not its tensors or the objects it holds).
PLAIN = (bool, int, float, str, type(None), torch.dtype)


def module_structure(module: torch.nn.Module) -> list[Any]:
    """What of a built module its program depends on besides its weights' values: each
    submodule's class and plain attributes, and the parameters' and buffers' names, shapes and
    dtypes."""
    tree = [
        [name, type(m).__qualname__, sorted([k, repr(v)] for k, v in vars(m).items() if isinstance(v, PLAIN))]
        for name, m in module.named_modules()
    ]
    tensors = sorted([n, list(t.shape), str(t.dtype)] for n, t in module.state_dict(keep_vars=True).items())
    return [tree, tensors]


def tensors_of(outputs: Any) -> list[torch.Tensor]:
    """A program's outputs as a list of tensors (one tensor, or a tuple of them)."""
    return [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)


def shape_name(tensors: Sequence[torch.Tensor]) -> str:
    """A call's shapes in a program's record (``1x32x64_1x1x32x32_...``)."""
    return "_".join("x".join(str(n) for n in t.shape) for t in tensors)


def call_signature(tensors: Sequence[torch.Tensor]) -> list[list[Any]]:
    """A call's shapes and dtypes, as a program's key holds them."""
    return [[list(t.shape), str(t.dtype)] for t in tensors]


@dataclass(frozen=True)
class ProgramKey:
    """What makes two programs differ; ``name`` is the program's entry in the compile cache."""

    tag: str
    digest: str

    @property
    def name(self) -> str:
        return f"{self.tag}-{self.digest[:16]}"


@dataclass
class Program:
    """A built program and the layer whose weights it holds."""

    key: ProgramKey
    module: Any  # what the builder returned: called with the example's tensors; ``nxd_model`` its weights
    example: tuple[torch.Tensor, ...]
    compiler_args: str
    workdir: Path
    holds: int
    loaded_from: int  # the layer it held before its last swap
    swapped_by: str = ""  # the NxD model's method of its last weight swap


@dataclass
class Compiled:
    """A program the builder made: its key, the layer it was built with, and with what."""

    key: str
    layer: int
    tag: str
    shapes: str
    compiler_args: str
    workdir: str
