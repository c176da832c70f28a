"""``--port nxdi --target neuron``: NxDI's decoder layers compiled the way NxDI compiles a
module, once per distinct program, then called on host tensors.

The builder is neuronx-distributed-inference's ``utils.testing.build_module`` (or what a
conftest's ``pytest_layerparity_nxdi_build_module`` returns in its place): NxD's
``ModelBuilder`` traces the program and neuronx-cc compiles it, in one process over
``tp_degree`` NeuronCores. Each program is the layer of the model NxDI makes for its tag
(``model_tags.py``): context encoding in the prompt pass, token generation in a decode step,
with the tag's config (``is_prefill_stage`` and the rest, as NxDI's ``model_base`` sets them),
compiler arguments (the application's ``get_compiler_args()`` completed by NxDI's
``ModelWrapper``) and ``priority_model_idx`` (the weight-layout optimisation: token generation
only). ModelBuilder sets up its own process group and ``parallel_state`` for the trace and
destroys both after it: the plugin holds none on this path, and checks after each build that
none was left behind.

The logical NeuronCore config has one source, as in NxDI's ``application_base.get_builder``
(``logical_nc_config=self.neuron_config.logical_nc_config``): the layer's NeuronConfig, which
NxDI resolves (``models/config.py``, ``_get_lnc``: ``NEURON_LOGICAL_NC_CONFIG``, else the
``logical_nc_config`` given, else the platform's, 2 on Trn2). That one value goes to
``build_module`` (ModelBuilder's ``parallel_state`` and its weight-layout program's ``--lnc``),
to the ``--lnc`` NxDI's ``ModelWrapper`` writes into the layer's compiler arguments (where the
application has none of its own), to the ModelBuilder that shards each layer's weights and to
the ``parallel_state`` the plugin sets up to build a layer on the meta device (``lnc_size``,
which picks how NxD lays its replica groups over the cores).

One build per program, as NxDI compiles a model: a program is keyed by what makes programs
differ (:class:`ProgramKey`): the application, the layer's structure (its per-layer config as
NxDI serialises it, so sliding and global layers differ where ``get_updated_configs`` makes
them; the module tree NxDI builds for it, with its parameters' names, shapes and dtypes, so
dense and MoE layers differ, and its plain attributes, so a layer that keeps its index, as
Gemma-3's does to scale layer 0's input, gets a program of its own), the model tag and call
shape, the compiler arguments and the placement. The layer index is not in it. The first
layer to call a program is compiled with its own converted checkpoint; any other layer of
the same key has its checkpoint sharded the way NxDI shards on load (``ModelBuilder.
shard_checkpoint``, which runs on the CPU) and loaded into the built program through NxD's
weight API (``replace_weights(sharded)`` where the NxD model has it, ModelBuilderV2's; else
``initialize(sharded, start_rank)``, what NxDI's ``load_weights`` calls on the model
ModelBuilder built). Each program knows which layer's weights it holds, and they are swapped
only when another layer calls it. The session's first swap is held against a fresh build of
the same layer on the same call (:meth:`CompiledPrograms.check_swap`): what the SDK does with
new weights for an initialised model is closed source, so it is verified once where it runs.

What a Trainium user saves (measured with the CPU stand-in builder, tests/nxdi): a 6-layer
Llama with 2 decode steps built 36 programs for its 13 tests (each layer's prompt and each
decode step, twice: the layer tests, then the whole model), and layer 0 alone built 3; both
now build 2 (context encoding, token generation). MiniMax-M2's 62 layers (every one MoE with
full attention: one kind, if its port's layer keeps no index) go from 372 neuronx-cc runs of
minutes each to 2; a model with K kinds of layer needs 2 x K.

The compile cache (``--compile-cache DIR``) holds one entry per program,
``DIR/nxdi/<application>/<model tag>-<key>/``: the compiler workdir and the checkpoint the
program was built with.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .kv_layout import KvLayout
from .model_tags import layer_config, program_tag, tag_model
from .program import (
    Compiled,
    LayerProgram,
    Program,
    ProgramKey,
    call_signature,
    check_nothing_left,
    module_structure,
    program_state,
    shape_name,
    tensors_of,
)

BuildModule = Callable[..., Any]


class WeightSwapMismatch(RuntimeError):
    """A program given another layer's weights does not compute what a fresh build of that layer
    computes."""


def nxdi_build_module() -> BuildModule:
    """neuronx-distributed-inference's own ``build_module``."""
    from neuronx_distributed_inference.utils.testing import build_module

    return build_module


@contextmanager
def traced_world(tp_degree: int, logical_nc_config: int) -> Iterator[None]:
    """The world ModelBuilder traces and shards in (``ModelBuilder.trace``/``shard_checkpoint``:
    a mocked process group of ``tp_degree`` ranks, ``parallel_state`` for it, modules built on the
    meta device), set up and destroyed around one use."""
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.trace.mock_torchdist import mock_distributed
    from neuronx_distributed.utils.model_utils import init_on_device

    with mock_distributed(world_size=tp_degree), init_on_device(torch.device("meta"), force_custom_init_on_device=True):
        torch.distributed.init_process_group(backend="xla", rank=0, world_size=tp_degree)  # the mocked one
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp_degree,
            pipeline_model_parallel_size=1,
            expert_model_parallel_size=1,  # build_module's ModelBuilder: moe_ep comes from the neuron config
            skip_collective_init=True,
            lnc_size=logical_nc_config,
        )
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()


@dataclass
class CompiledLayer:
    """One decoder layer of the port as the compiled programs see it: how NxDI builds it (the
    application ``app``, ``layer_cls``, the application's ``config``, ``index``) and its
    converted, unsharded checkpoint (``state()``, names relative to the layer)."""

    app: type
    layer_cls: type
    config: Any
    index: int
    state: Callable[[], dict[str, torch.Tensor]]
    _models: dict[str, Any] = field(default_factory=dict)
    _structures: dict[str, str] = field(default_factory=dict)
    _layouts: dict[str, KvLayout | None] = field(default_factory=dict)  # by tag, beside _structures

    @property
    def lnc(self) -> int:
        """The logical NeuronCore config of every program of this layer: its NeuronConfig's, as
        NxDI's application hands it to ModelBuilder (``application_base.get_builder``)."""
        return int(self.config.neuron_config.logical_nc_config)

    def model(self, tag: str) -> Any:
        """The ``ModelWrapper`` NxDI's application makes for ``tag`` (its config, compiler
        arguments and ``priority_model_idx``), once per tag."""
        if tag not in self._models:
            self._models[tag] = tag_model(self.app, self.config, tag)
        return self._models[tag]

    def init(self, tag: str) -> dict[str, Any]:
        """The program's init kwargs for ``tag``: the layer built from the tag's config, as NxDI's
        model of that tag builds layer ``index``."""
        config = layer_config(self.layer_cls, self.model(tag).config, self.index)
        return {"layer_cls": self.layer_cls, "config": config, "index": self.index}

    def compiler_args(self, tag: str) -> str:
        return self.model(tag).compiler_args

    def priority_model_idx(self, tag: str) -> int | None:
        """0 (the weight-layout optimisation) for token generation, None for context encoding,
        as NxDI's ``model_base`` gives its models."""
        return self.model(tag).priority_model_idx

    def kv_layout(self) -> KvLayout | None:
        """How the programs' ranks hold the KV heads (None in one rank, or where no module of the
        layer shards them): read off the token-generation program's layer as :meth:`structure`
        builds it."""
        if self.tp <= 1:
            return None
        tag = program_tag(past=True)
        self.structure(tag, self.tp)
        return self._layouts[tag]

    @property
    def tp(self) -> int:
        return int(self.config.neuron_config.tp_degree)

    def structure(self, tag: str, tp_degree: int) -> str:
        """A digest of the layer's structure in ``tag``'s program: its config as NxDI serialises
        it and the module NxDI builds from it, built on the meta device as ModelBuilder builds it
        (once per tag; how its ranks hold the KV heads kept beside, :meth:`kv_layout`)."""
        if tag not in self._structures:
            init = self.init(tag)
            with traced_world(tp_degree, self.lnc):  # MoE layers read their groups in state_dict()
                program = LayerProgram(**init)
                structure = module_structure(program)
                self._layouts[tag] = KvLayout.of(program, tp_degree)
            check_nothing_left()
            text = json.dumps([init["config"].to_json_string(), structure])
            self._structures[tag] = hashlib.sha256(text.encode()).hexdigest()
        return self._structures[tag]


@dataclass
class CompiledPrograms:
    """Compiles the programs of one session's layers, one per :class:`ProgramKey` (``root``:
    the compile-cache folder, else a temporary one removed at the end), and loads each layer's
    weights into its program when that layer calls it."""

    given_builder: BuildModule | None = None  # None: NxDI's own build_module
    tp_degree: int = 1
    ep_degree: int = 1  # NxDI's moe_ep_degree; the ranks are still tp_degree (moe_ep x moe_tp)
    logical_nc_config: int | None = None  # layerparity_logical_nc_config; None: the NeuronConfig resolves it
    root: Path | None = None
    compiled: list[Compiled] = field(default_factory=list)
    programs: dict[ProgramKey, Program] = field(default_factory=dict)
    loads: list[tuple[str, int]] = field(default_factory=list)  # (program, layer) of each weight swap
    swap_check: str | None = None  # what the first swap's check against a fresh build found
    swap_failed: bool = False  # that check failed: no later swap is made (each would fail alike)
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

    def folder(self, app: type, key: ProgramKey) -> Path:
        if self.root is None:
            self._temporary = tempfile.mkdtemp(prefix="layerparity-nxdi-")
            self.root = Path(self._temporary)
        path = self.root / "nxdi" / app.__name__ / key.name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def key(self, layer: CompiledLayer, example: tuple[torch.Tensor, ...]) -> ProgramKey:
        """The program ``layer`` needs for calls shaped like ``example``: the same for every
        layer of the same structure."""
        tag = program_tag(past=len(example) > 3)
        fields = {
            "application": f"{layer.app.__module__}.{layer.app.__qualname__}",
            "layer": layer.structure(tag, self.tp_degree),
            "call": call_signature(example),
            "compiler_args": layer.compiler_args(tag),
            "priority_model_idx": layer.priority_model_idx(tag),
            "placement": [self.tp_degree, self.ep_degree, layer.lnc],
        }
        return ProgramKey(tag, hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest())

    def run(self, layer: CompiledLayer, example: tuple[torch.Tensor, ...]) -> Any:
        """``layer`` called with ``example``: its program (built at the first call of its key),
        holding its weights."""
        return self.program(layer, example).module(*example)

    def program(self, layer: CompiledLayer, example: tuple[torch.Tensor, ...]) -> Program:
        key = self.key(layer, example)
        program = self.programs.get(key)
        if program is None:
            program = self.programs[key] = self.build(layer, key, example)
        elif program.holds != layer.index:
            if self.swap_failed:
                raise WeightSwapMismatch(f"{self.swap_check} (the session's first swap; no later swap is made)")
            self.load(program, layer)
            if self.swap_check is None:
                self.check_swap(program, layer, example)
        return program

    def check_swap(self, program: Program, layer: CompiledLayer, example: tuple[torch.Tensor, ...]) -> None:
        """The session's first weight swap held against a fresh build of the same layer, on the
        same call: what the SDK does when an initialised program is given new weights is in
        closed source, so it is verified once where it runs. Equal outputs, bit for bit, or
        :class:`WeightSwapMismatch` (the swapped program computes with other weights)."""
        fresh = self.build(layer, program.key, example, check=True)
        swapped, built = tensors_of(program.module(*example)), tensors_of(fresh.module(*example))
        pairs = list(zip(swapped, built, strict=False))
        name, method, index = program.key.name, f"nxd_model.{program.swapped_by}", layer.index
        if len(swapped) != len(built) or not all(torch.equal(a, b) for a, b in pairs):
            worst = max(((a.double() - b.double()).abs().max().item() for a, b in pairs), default=float("nan"))
            self.swap_failed = True
            self.swap_check = (
                f"layer {index}'s weights swapped into program {name} (built with layer {program.loaded_from}'s) "
                f"do not compute what a fresh build with layer {index}'s weights computes on the same call (largest "
                f"difference {worst:.3g}): the SDK's weight loading into a built program ({method}) does not give it "
                "the weights a build does, so the layers that share a program would not run with their own weights; "
                "this Neuron SDK's weight swap cannot be used: report it to its maintainers with this message"
            )
            raise WeightSwapMismatch(self.swap_check)
        self.swap_check = (
            f"the first weight swap (layer {index} into program {name}, by {method}) computes what a fresh build "
            f"with layer {index}'s weights computes, bit for bit"
        )

    def build(
        self, layer: CompiledLayer, key: ProgramKey, example: tuple[torch.Tensor, ...], check: bool = False
    ) -> Program:
        """The program of ``key``, compiled with ``layer``'s checkpoint (``check``: the first
        swap's reference build, in a workdir of its own)."""
        from filelock import FileLock

        args = layer.compiler_args(key.tag)
        folder = self.folder(layer.app, key) / "swap-check" if check else self.folder(layer.app, key)
        folder.mkdir(parents=True, exist_ok=True)
        workdir = folder / "workdir"  # ModelBuilder empties it first: the checkpoint lies beside it
        checkpoint = folder / "checkpoint.pt"
        with FileLock(str(folder / ".lock")):  # xdist workers may build the same program
            self._write_checkpoint(checkpoint, program_state(layer.state(), self.tp_degree))
            module = self.build_module(
                LayerProgram,
                [example],
                module_init_kwargs=layer.init(key.tag),
                tp_degree=self.tp_degree,
                world_size=self.tp_degree,  # expert parallelism divides these ranks, it adds none
                local_ranks_size=self.tp_degree,
                compiler_args=args,
                compiler_workdir=str(workdir),
                checkpoint_path=str(checkpoint),
                priority_model_idx=layer.priority_model_idx(key.tag),
                logical_nc_config=layer.lnc,  # the NeuronConfig's, as NxDI's application passes it
            )
        check_nothing_left()
        if not check:
            self.compiled.append(Compiled(key.name, layer.index, key.tag, shape_name(example), args, str(workdir)))
        return Program(key, module, example, args, workdir, holds=layer.index, loaded_from=layer.index)

    def load(self, program: Program, layer: CompiledLayer) -> None:
        """``layer``'s weights into ``program`` (built with another layer of its key), sharded as
        NxDI shards on load: by the NxD model's ``replace_weights`` where it has one (ModelBuilderV2's
        ``NxDModel``: the weights of a model already on the device replaced), else by
        ``initialize`` as NxDI's ``load_weights`` hands them (ranks from 0: one process over the
        ranks)."""
        sharded = self.shard(program, layer)
        model = program.module.nxd_model
        if callable(getattr(model, "replace_weights", None)):
            model.replace_weights(sharded)
            program.swapped_by = "replace_weights"
        else:
            model.initialize(sharded, torch.tensor([0], dtype=torch.int32))
            program.swapped_by = "initialize"
        program.loaded_from, program.holds = program.holds, layer.index
        self.loads.append((program.key.name, layer.index))

    def shard(self, program: Program, layer: CompiledLayer) -> list[dict[str, torch.Tensor]]:
        """``layer``'s converted checkpoint, one state dict per rank, by a ModelBuilder made as
        ``build_module`` makes it, through its ``shard_checkpoint`` (NxDI's ``load_weights``
        without a pre-sharded checkpoint)."""
        from neuronx_distributed.trace import ModelBuilder
        from neuronx_distributed.trace.model_builder import BaseModelInstance

        state = program_state(layer.state(), self.tp_degree)
        builder = ModelBuilder(
            router=None,
            tp_degree=self.tp_degree,
            world_size=self.tp_degree,
            local_ranks_size=self.tp_degree,
            checkpoint_loader=lambda: state,
            compiler_workdir=str(program.workdir),
            logical_nc_config=layer.lnc,
        )
        tag = program.key.tag
        builder.add(
            key=LayerProgram.__name__,
            model_instance=BaseModelInstance(partial(LayerProgram, **layer.init(tag)), input_output_aliases={}),
            example_inputs=[program.example],
            compiler_args=program.compiler_args,
            priority_model_idx=layer.priority_model_idx(tag),  # as build() gave build_module
        )
        sharded = builder.shard_checkpoint()
        check_nothing_left()
        return sharded

    def _write_checkpoint(self, path: Path, state: dict[str, torch.Tensor]) -> None:
        """A program's checkpoint (:func:`program_state`), written atomically."""
        partial_path = path.with_name(f".{path.name}.{os.getpid()}")
        torch.save(state, partial_path)
        os.replace(partial_path, path)

    def describe(self, lnc: str) -> str:
        """The header's words; ``lnc``: the logical NeuronCore config and where it comes from."""
        where = self.root if self._temporary is None and self.root is not None else "a temporary folder"
        return (
            f"compiled once per program (layer kind and call shape; other layers' weights loaded into it, the first "
            "swap checked against a fresh build of its layer) by "
            f"{self.builder_name} (tp_degree {self.tp_degree}, "
            + (f"moe_ep_degree {self.ep_degree}, " if self.ep_degree > 1 else "")
            + f"logical_nc_config {lnc}; compiler workdirs under {where})"
        )

    def cleanup(self) -> None:
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None
            self.root = None
