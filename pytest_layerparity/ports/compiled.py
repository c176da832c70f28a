"""``--port nxdi --target neuron``: each layer of the NxDI port compiled the way NxDI compiles
a module, then called on host tensors.

The builder is neuronx-distributed-inference's ``utils.testing.build_module`` (or what a
conftest's ``pytest_layerparity_nxdi_build_module`` returns in its place): NxD's
``ModelBuilder`` traces the program and neuronx-cc compiles it, in one process over
``tp_degree`` NeuronCores, with the arguments NxDI compiles the model with (the application's
``get_compiler_args()``, completed by NxDI's ``ModelWrapper`` for the context-encoding model
in the prompt pass and the token-generation model in a decode step), ``tp_degree`` and
``logical_nc_config``. ModelBuilder sets up its own process group and ``parallel_state`` for
the trace and destroys both after it: the plugin holds none on this path, and checks after
each build that none was left behind.

One program per layer and call shape (prompt pass; each decode step, whose past grows by one).
The checkpoint handed to the builder is layer N's converted, unsharded state dict (what NxDI's
application class makes of the HF checkpoint); ModelBuilder shards it over the ranks.
"""

from __future__ import annotations

import copy
import inspect
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

BuildModule = Callable[..., Any]


class ProcessGroupLeftBehind(RuntimeError):
    """The builder returned with a process group or parallel_state still set up."""


def nxdi_build_module() -> BuildModule:
    """neuronx-distributed-inference's own ``build_module``."""
    from neuronx_distributed_inference.utils.testing import build_module

    return build_module


def program_tag(past: bool) -> str:
    """The NxDI model whose compiler arguments a program gets: token generation for a decode
    step (a past is given), context encoding for the prompt pass."""
    from neuronx_distributed_inference.models.model_wrapper import (
        CONTEXT_ENCODING_MODEL_TAG,
        TOKEN_GENERATION_MODEL_TAG,
    )

    return TOKEN_GENERATION_MODEL_TAG if past else CONTEXT_ENCODING_MODEL_TAG


def compiler_args(app: type, config: Any, tag: str) -> str:
    """The neuronx-cc arguments NxDI compiles the model ``tag`` of ``app`` with: the
    application's ``get_compiler_args()`` (Qwen3-MoE's reads the tag as ``compile_tag``; None
    means NxDI's default for the tag), passed through ``ModelWrapper``, which appends what it
    always appends, as the application does when it creates its models."""
    from neuronx_distributed_inference.models.model_wrapper import ModelWrapper

    config = copy.deepcopy(config)  # ModelWrapper adjusts the neuron config of token generation
    probe = app.__new__(app)  # the application's own method, without loading a model
    torch.nn.Module.__init__(probe)
    probe.config = config
    probe.neuron_config = config.neuron_config
    probe.compile_tag = tag
    return ModelWrapper(config, model_cls=None, tag=tag, compiler_args=probe.get_compiler_args()).compiler_args


def make_layer(layer_cls: type, config: Any, index: int) -> torch.nn.Module:
    """NxDI's decoder layer ``index`` of ``layer_cls`` for ``config`` (with ``layer_idx`` where it takes one)."""
    params = inspect.signature(layer_cls.__init__).parameters
    return layer_cls(config, index) if "layer_idx" in params else layer_cls(config)


class LayerProgram(torch.nn.Module):
    """What is compiled for a layer: NxDI's decoder layer taking positional tensors (hidden
    states, boolean mask, position ids, and in a decode step the past keys and values) and
    returning tensors (its output, then the keys and values it made)."""

    def __init__(self, layer_cls: type, config: Any, index: int) -> None:
        super().__init__()
        self.layer = make_layer(layer_cls, config, index).eval()
        dtype = config.neuron_config.torch_dtype
        if dtype != torch.float32:
            self.layer.to(dtype)  # as NxDI's get_trace_callable does

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        outputs = self.layer(
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_value=tuple(past) if past else None,
        )
        if not isinstance(outputs, (tuple, list)):
            return (outputs,)
        present = outputs[1] if len(outputs) > 1 else None
        if isinstance(present, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in present):
            return (outputs[0], *present)
        return (outputs[0],)


def _shape_name(tensors: Sequence[torch.Tensor]) -> str:
    return "_".join("x".join(str(n) for n in t.shape) for t in tensors)


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


@dataclass
class Compiled:
    """A program the builder made: which layer and call, with what."""

    layer: int
    tag: str
    shapes: str
    compiler_args: str
    workdir: str


@dataclass
class CompiledPrograms:
    """Compiles the programs of one session's layers (``root``: the compile-cache folder, else
    a temporary one removed at the end) and keeps each for its layer and call shape."""

    given_builder: BuildModule | None = None  # None: NxDI's own build_module
    tp_degree: int = 1
    ep_degree: int = 1  # NxDI's moe_ep_degree; the ranks are still tp_degree (moe_ep x moe_tp)
    logical_nc_config: int | None = None
    root: Path | None = None
    compiled: list[Compiled] = field(default_factory=list)
    _temporary: str | None = None

    @property
    def build_module(self) -> BuildModule:
        return self.given_builder if self.given_builder is not None else nxdi_build_module()

    @property
    def builder_name(self) -> str:
        builder = self.given_builder
        if builder is None:
            return "neuronx_distributed_inference.utils.testing.build_module"
        name = f"{getattr(builder, '__module__', '?')}.{getattr(builder, '__qualname__', repr(builder))}"
        return f"{name} (a conftest's pytest_layerparity_nxdi_build_module)"

    def folder(self, app: type, index: int) -> Path:
        if self.root is None:
            self._temporary = tempfile.mkdtemp(prefix="layerparity-nxdi-")
            self.root = Path(self._temporary)
        path = self.root / "nxdi" / app.__name__ / f"layer_{index}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def build(
        self,
        app: type,
        layer_cls: type,
        config: Any,
        index: int,
        state: Callable[[], dict[str, torch.Tensor]],
        example: tuple[torch.Tensor, ...],
    ) -> Callable[..., Any]:
        """Layer ``index``'s program for calls shaped like ``example`` (its checkpoint from
        ``state()``, the converted layer)."""
        from filelock import FileLock

        tag = program_tag(past=len(example) > 3)
        args = compiler_args(app, config, tag)
        folder = self.folder(app, index)
        workdir = folder / f"{tag}-{_shape_name(example)}"
        checkpoint = folder / "checkpoint.pt"
        init = {"layer_cls": layer_cls, "config": config, "index": index}
        with FileLock(str(folder) + ".lock"):  # xdist workers may compile the same layer
            if not self._wrote(index):  # once per process: a file left by another session may be stale
                self._write_checkpoint(checkpoint, state())
            extra = {} if self.logical_nc_config is None else {"logical_nc_config": self.logical_nc_config}
            program = self.build_module(
                LayerProgram,
                [example],
                module_init_kwargs=init,
                tp_degree=self.tp_degree,
                world_size=self.tp_degree,  # expert parallelism divides these ranks, it adds none
                local_ranks_size=self.tp_degree,
                compiler_args=args,
                compiler_workdir=str(workdir),
                checkpoint_path=str(checkpoint),
                **extra,
            )
        check_nothing_left()
        self.compiled.append(Compiled(index, tag, _shape_name(example), args, str(workdir)))
        return program

    def _wrote(self, index: int) -> bool:
        return any(c.layer == index for c in self.compiled)

    def _write_checkpoint(self, path: Path, state: dict[str, torch.Tensor]) -> None:
        """Layer ``index``'s converted state under the program's names, written atomically."""
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        torch.save({f"layer.{k}": v for k, v in state.items()}, partial)
        os.replace(partial, path)

    def describe(self) -> str:
        lnc = "NxDI's default" if self.logical_nc_config is None else str(self.logical_nc_config)
        where = self.root if self._temporary is None and self.root is not None else "a temporary folder"
        return (
            f"compiled per layer and call shape by {self.builder_name} (tp_degree {self.tp_degree}, "
            + (f"moe_ep_degree {self.ep_degree}, " if self.ep_degree > 1 else "")
            + f"logical_nc_config {lnc}; compiler workdirs under {where})"
        )

    def cleanup(self) -> None:
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None
            self.root = None
