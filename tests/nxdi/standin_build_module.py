"""A CPU stand-in for neuronx-distributed-inference's ``utils.testing.build_module`` (named as
one: the real one traces with NxD's ModelBuilder and compiles with neuronx-cc, which cannot run
here). What it keeps of the real contract, so that the plugin's ``--port nxdi --target neuron``
wiring is tested against it:

- the signature: the real one's parameters, in order, of the same kinds and defaults
  (``test_signatures.py`` holds it, and ``StandinNxDModel.initialize``'s, against NxD's and
  NxDI's sources);
- the arguments: ``example_inputs`` a list of exactly one tuple of tensors, the module class
  and its init kwargs, ``checkpoint_path`` loaded with ``checkpoint_loader_fn`` and sharded with
  NxD's ``get_sharded_checkpoint`` into the module built from them (every parameter must come
  from the checkpoint, as ModelBuilder's weight loading needs);
- the process group: like ModelBuilder's trace (``trace/model_builder.py``, ``trace``) it sets
  up its own (a world of ``tp_degree``) and runs NxD's own ``parallel_state.
  initialize_model_parallel(tp_degree, 1, expert_model_parallel_size=1,
  skip_collective_init=True, lnc_size=logical_nc_config)`` to build the module, and destroys both
  before returning, so a process group the caller left set up makes it fail the way the real one
  does (torch refuses a second default group);
- one logical NeuronCore config: ``logical_nc_config`` is what ModelBuilder lays
  ``parallel_state`` out for and compiles its weight-layout program with (``--lnc``); a program
  whose compiler arguments carry another ``--lnc``, or whose module's NeuronConfig has another
  ``logical_nc_config``, would be a pair of programs (or a program and its replica groups) for two
  core layouts, so the stand-in refuses it, naming both values;
- the compiled program: called with tensors of exactly the example's shapes and dtypes (a NEFF
  takes nothing else), on host tensors, returning a tuple of host tensors;
- its weights: NxD's weight API of the model ModelBuilder builds (``trace/spmd.py``: the traced
  ``NxDModelExecutor``'s ``nxd_model``), ``nxd_model.initialize(checkpoint, start_rank_tensor)``:
  a list of one state dict per rank (``local_ranks_size`` of them) and the first rank as a
  tensor, loaded strictly (a missing or unexpected name, or a shape that differs, is an error),
  with the build's one exception: a ``rank_util.rank`` the application's converter leaves out
  (NxD's SPMDRank, which Mixtral's converter gives the model only; at ``tp_degree`` 1 the
  module's own value is the rank). ModelBuilder's model has no ``replace_weights`` (that is
  ModelBuilderV2's NxDModel), so neither has this one; :func:`replacing_weights` gives a
  builder's programs ModelBuilderV2's, which has it.

- SPMD over ``tp_degree`` ranks: at ``tp_degree`` > 1 the checkpoint is sharded per rank as
  ModelBuilder shards it (``get_sharded_checkpoint`` under a mocked world of the ranks, the
  module on the meta device), and the program runs on ``tp_degree`` rank processes (:class:`Ranks`,
  the stand-in's NeuronCores), each NxD's CPU mode in one gloo group of the ranks with
  ``parallel_state`` laid out for ``logical_nc_config``, each holding its own rank's weights:
  every rank is given the same inputs, the collectives run between the ranks, and rank 0's
  outputs are returned, as NxD's ``NxDModel`` returns them. A caller that hands a rank-split
  tensor as a whole, or reads rank 0's keys and values as every rank's, is wrong here as on
  the hardware.

Where it differs from the real one: NxDI's layer runs eagerly (its CPU branches, not the ones
neuronx-cc would trace), and no ``checkpoint_path`` is refused rather than filled with random
weights.

Each build is recorded, one JSON line in ``builds.jsonl`` in the working directory: what the
plugin passed and the module's NeuronConfig settings; each weight load one line in
``loads.jsonl``. :func:`record_nxd_calls` records the calls the plugin makes to NxD's
``ModelBuilder`` and ``parallel_state.initialize_model_parallel`` (and this builder's own, and
ModelBuilder's) in ``nxd_calls.jsonl``: who called, the arguments as given, bound to the real
signature.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import inspect
import json
import multiprocessing
import os
import re
import sys
import tempfile
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

#: The logical NeuronCore config a compiler argument sets (NxDI's ModelWrapper writes ``--lnc=N``).
LNC_FLAG = re.compile(r"--lnc[= ](\d+)")
#: The settings NxDI's model_base puts in each model tag's NeuronConfig, recorded per build.
TAG_SETTINGS = (
    "is_prefill_stage",
    "batch_size",
    "n_active_tokens",
    "bucket_n_active_tokens",
    "sequence_parallel_enabled",
    "buckets",
    "cc_pipeline_tiling_factor",
    "logical_nc_config",
)


def _append(name: str, record: dict[str, Any]) -> None:
    with open(name, "a") as sink:
        sink.write(json.dumps(record) + "\n")


def _traced_parallel_state(tp_degree: int, logical_nc_config: int) -> None:
    """NxD's ``parallel_state`` set up as ModelBuilder's trace and sharding set it up."""
    from neuronx_distributed.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp_degree,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=1,
        skip_collective_init=True,
        lnc_size=logical_nc_config,
    )


@contextmanager
def world(tp_degree: int, logical_nc_config: int):
    from neuronx_distributed.parallel_layers import parallel_state

    before = os.environ.get("NXD_CPU_MODE")
    os.environ["NXD_CPU_MODE"] = "1"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=tp_degree)
    try:
        _traced_parallel_state(tp_degree, logical_nc_config)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
        if before is None:
            del os.environ["NXD_CPU_MODE"]
        else:
            os.environ["NXD_CPU_MODE"] = before


@contextmanager
def mocked_world(tp_degree: int, logical_nc_config: int):
    """The world ModelBuilder shards a checkpoint in (``trace/model_builder.py``,
    ``shard_checkpoint``): a mocked process group of the ranks, ``parallel_state`` for it,
    modules built on the meta device."""
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.trace.mock_torchdist import mock_distributed
    from neuronx_distributed.utils.model_utils import init_on_device

    with mock_distributed(world_size=tp_degree), init_on_device(torch.device("meta"), force_custom_init_on_device=True):
        torch.distributed.init_process_group(backend="xla", rank=0, world_size=tp_degree)  # the mocked one
        _traced_parallel_state(tp_degree, logical_nc_config)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()


def _strict_load(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str = "initialize") -> None:
    """``state`` into ``module``, every name and shape as the module's (the build's one exception:
    a ``rank_util.rank`` the application's converter leaves out, see :func:`build_module`)."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("rank_util.rank")]
    if missing or unexpected:
        raise RuntimeError(f"{what}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")


def _rank_main(conn: Any, rank: int, tp_degree: int, logical_nc_config: int, rendezvous: str) -> None:
    """One rank of the stand-in device: NxD's CPU mode in the ranks' gloo group; builds, loads
    and runs what the parent sends, replying ("ok", result) or ("error", text)."""
    os.environ["NXD_CPU_MODE"] = "1"
    torch.set_num_threads(1)
    from pytest_layerparity.ports import standins

    standins.install()
    from neuronx_distributed.parallel_layers import parallel_state

    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=tp_degree,
        timeout=datetime.timedelta(seconds=120),  # a rank that failed mid-collective
    )
    # NxD's own set-up, collectives included (skip_collective_init's default)
    parallel_state.initialize_model_parallel(tp_degree, 1, expert_model_parallel_size=1, lnc_size=logical_nc_config)
    programs: dict[int, torch.nn.Module] = {}
    while True:
        kind, *args = conn.recv()
        if kind == "stop":
            return
        try:
            if kind == "build":
                number, module_cls, init_kwargs = args
                programs[number] = module_cls(**init_kwargs).eval()
                result = None
            elif kind == "load":
                number, state, *what = args
                _strict_load(programs[number], state, *what)
                result = None
            else:  # "call"
                number, inputs = args
                with torch.no_grad():
                    result = tuple(t.detach().clone() for t in programs[number](*inputs))
            conn.send(("ok", result))
        except Exception as exc:  # sent back to the caller, who raises it
            conn.send(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class Ranks:
    """The stand-in's NeuronCores for ``tp_degree`` > 1: one process per rank (spawned once per
    (tp_degree, logical_nc_config) and kept for the session), each holding every program's
    module with its own rank's weights."""

    _started: ClassVar[dict[tuple[int, int], Ranks]] = {}

    def __init__(self, tp_degree: int, logical_nc_config: int) -> None:
        spawn = multiprocessing.get_context("spawn")
        self.folder = tempfile.mkdtemp(prefix="standin-ranks-")
        rendezvous = os.path.join(self.folder, "rendezvous")
        self.pipes = []
        self.processes = []
        for rank in range(tp_degree):
            ours, theirs = spawn.Pipe()
            process = spawn.Process(
                target=_rank_main, args=(theirs, rank, tp_degree, logical_nc_config, rendezvous), daemon=True
            )
            process.start()
            self.pipes.append(ours)
            self.processes.append(process)
        self.programs = 0

    @classmethod
    def of(cls, tp_degree: int, logical_nc_config: int) -> Ranks:
        key = (tp_degree, logical_nc_config)
        if key not in cls._started:
            cls._started[key] = cls(tp_degree, logical_nc_config)
        return cls._started[key]

    def ask(self, messages: list[tuple]) -> list[Any]:
        """Message r to rank r, all sent before any reply is read (the ranks run together)."""
        for pipe, message in zip(self.pipes, messages, strict=True):
            pipe.send(message)
        replies = [pipe.recv() for pipe in self.pipes]
        errors = [text for status, text in replies if status == "error"]
        if errors:
            raise RuntimeError("the stand-in's ranks failed:\n" + "\n".join(errors))
        return [result for _, result in replies]

    def stop(self) -> None:
        for pipe, process in zip(self.pipes, self.processes, strict=True):
            if process.is_alive():
                pipe.send(("stop",))
                process.join(timeout=10)


@atexit.register
def _stop_ranks() -> None:
    for ranks in Ranks._started.values():
        ranks.stop()


def shard_per_rank(
    module_cls: Any, module_init_kwargs: dict, state: dict[str, torch.Tensor], tp_degree: int, logical_nc_config: int
) -> list[dict[str, torch.Tensor]]:
    """``state`` sharded for each rank as ModelBuilder's ``shard_checkpoint`` shards it."""
    from neuronx_distributed.trace.trace import get_sharded_checkpoint

    sharded = []
    with mocked_world(tp_degree, logical_nc_config):
        module = module_cls(**module_init_kwargs)
        for rank in range(tp_degree):
            own = dict(state)
            get_sharded_checkpoint(own, module, rank, tp_degree)
            sharded.append(own)
    return sharded


class StandinNxDModel:
    """``nxd_model`` of the built program: NxD's ``NxDModel.initialize`` (trace/spmd.py)."""

    def __init__(self, program: StandinProgram, workdir: str) -> None:
        self.program = program
        self.workdir = workdir

    def initialize(self, checkpoint: list[dict[str, torch.Tensor]], start_rank_tensor: torch.Tensor) -> None:
        if not isinstance(start_rank_tensor, torch.Tensor) or start_rank_tensor.numel() != 1:
            raise TypeError("initialize takes the start rank as a one-element tensor")
        self._load(checkpoint, int(start_rank_tensor), "initialize")

    def _load(self, checkpoint: list[dict[str, torch.Tensor]], start: int, method: str) -> None:
        if not (
            isinstance(checkpoint, list)
            and all(isinstance(d, dict) and all(isinstance(t, torch.Tensor) for t in d.values()) for d in checkpoint)
        ):
            raise TypeError(f"{method} takes a list of state dicts (one per rank)")
        if len(checkpoint) != self.program.tp_degree:
            raise ValueError(f"{method}: {len(checkpoint)} state dicts for {self.program.tp_degree} ranks")
        ranks = self.program.ranks
        if ranks is None:  # one process, one rank: the list's first state dict is rank start's
            _strict_load(self.program.module, checkpoint[0], method)
        else:  # the list's state dict r is rank start + r's
            ranks.ask([("load", self.program.number, state, method) for state in checkpoint])
        _append(
            "loads.jsonl",
            {
                "workdir": self.workdir,
                "method": method,
                "ranks": len(checkpoint),
                "start_rank": start,
                "names": len(checkpoint[0]),
            },
        )


class StandinNxDModelV2(StandinNxDModel):
    """``nxd_model`` of the model NxD's ModelBuilderV2 builds (``trace/nxd_model/nxd_model.py``,
    ``NxDModel``), which has ``replace_weights``: the weights of a model already loaded on the
    device replaced, one state dict per rank."""

    def replace_weights(self, sharded_checkpoint: list[dict[str, torch.Tensor]]) -> None:
        self._load(sharded_checkpoint, 0, "replace_weights")


def replacing_weights(builder: Any) -> Any:
    """``builder`` whose programs' NxD model is ModelBuilderV2's (with ``replace_weights``)."""

    @functools.wraps(builder)
    def build(*args: Any, **kwargs: Any) -> Any:
        program = builder(*args, **kwargs)
        if program is not None:
            program.nxd_model = StandinNxDModelV2(program, program.nxd_model.workdir)
        return program

    return build


class StandinProgram:
    """A built program: at ``tp_degree`` 1 ``module`` run in this process; above, program
    ``number`` of the ``ranks``."""

    def __init__(
        self,
        module: torch.nn.Module | None,
        example: tuple[torch.Tensor, ...],
        tp_degree: int,
        workdir: str,
        logical_nc_config: int = 1,
        ranks: Ranks | None = None,
        number: int = 0,
    ) -> None:
        self.module = module
        self.signature = [(tuple(t.shape), t.dtype) for t in example]
        self.tp_degree = tp_degree
        self.logical_nc_config = logical_nc_config
        self.ranks = ranks
        self.number = number
        self.nxd_model = StandinNxDModel(self, workdir)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        given = [(tuple(t.shape), t.dtype) for t in inputs]
        if given != self.signature:
            raise ValueError(f"the compiled program takes {self.signature}, was given {given}")
        if any(t.device.type != "cpu" for t in inputs):
            raise ValueError("the compiled program takes host tensors")
        if self.ranks is not None:  # SPMD: every rank the same inputs, rank 0's outputs returned
            return self.ranks.ask([("call", self.number, inputs)] * self.tp_degree)[0]
        assert self.module is not None
        with world(self.tp_degree, self.logical_nc_config), torch.no_grad():
            outputs = self.module(*inputs)
        return tuple(t.detach().clone() for t in outputs)


def one_core_layout(logical_nc_config: int, compiler_args: str | None, module_init_kwargs: dict) -> dict[str, Any]:
    """The logical NeuronCore configs a build would use, which must be one: ``logical_nc_config``
    (ModelBuilder's parallel_state and weight-layout program), the compiler arguments' ``--lnc``
    and the module's NeuronConfig's. Returns the tag settings of that NeuronConfig."""
    flags = sorted({int(n) for n in LNC_FLAG.findall(compiler_args or "")})
    if any(n != logical_nc_config for n in flags):
        raise ValueError(
            f"compiler_args compile the program with --lnc={flags[0]} and build_module was given logical_nc_config="
            f"{logical_nc_config}, which ModelBuilder lays parallel_state out for and compiles its weight-layout "
            "program with: two core layouts for one program"
        )
    neuron_config = getattr(module_init_kwargs.get("config"), "neuron_config", None)
    settings = {name: getattr(neuron_config, name, None) for name in TAG_SETTINGS}
    module_lnc = settings["logical_nc_config"]
    if module_lnc is not None and module_lnc != logical_nc_config:
        raise ValueError(
            f"the module's NeuronConfig has logical_nc_config {module_lnc} and build_module was given "
            f"logical_nc_config={logical_nc_config}: NxDI's application passes its NeuronConfig's "
            "(application_base.get_builder)"
        )
    return settings


def build_module(
    module_cls,
    example_inputs,
    module_init_kwargs={},  # noqa: B006 (the real default: test_signatures.py holds the two alike)
    tp_degree=1,
    world_size=None,
    local_ranks_size=None,
    compiler_args=None,
    compiler_workdir=None,
    checkpoint_path=None,
    priority_model_idx=0,
    logical_nc_config=1,
    dry_run=False,
    checkpoint_loader_fn=lambda checkpoint_path: torch.load(checkpoint_path),  # noqa: PLW0108 (the real default)
):
    from neuronx_distributed.trace.trace import get_sharded_checkpoint

    if not (
        isinstance(example_inputs, list)
        and len(example_inputs) == 1
        and isinstance(example_inputs[0], tuple)
        and all(isinstance(t, torch.Tensor) for t in example_inputs[0])
    ):
        raise ValueError("example_inputs must be a list of exactly one tuple of tensors")
    settings = one_core_layout(logical_nc_config, compiler_args, module_init_kwargs)
    if checkpoint_path is None or not Path(checkpoint_path).exists():
        raise FileNotFoundError(f"checkpoint_path {checkpoint_path}: the stand-in does not make random weights")
    workdir = Path(compiler_workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "compiler_args.txt").write_text(compiler_args or "")
    state = checkpoint_loader_fn(checkpoint_path)
    from neuronx_distributed.parallel_layers import parallel_state

    if tp_degree == 1:
        with world(tp_degree, logical_nc_config):
            layout = parallel_state._REPLICA_LOGIC.name  # how NxD laid the groups out for this core layout
            module = module_cls(**module_init_kwargs)
            get_sharded_checkpoint(state, module, 0, tp_degree)
            _strict_load(module, state, f"checkpoint {checkpoint_path}")
    else:
        with mocked_world(tp_degree, logical_nc_config):
            layout = parallel_state._REPLICA_LOGIC.name
        sharded = shard_per_rank(module_cls, module_init_kwargs, state, tp_degree, logical_nc_config)
    record = {
        "module": module_cls.__name__,
        "init": sorted(module_init_kwargs),
        "index": module_init_kwargs.get("index"),
        "example": [[list(t.shape), str(t.dtype)] for t in example_inputs[0]],
        "tp_degree": tp_degree,
        "world_size": world_size,
        "local_ranks_size": local_ranks_size,
        "logical_nc_config": logical_nc_config,
        "priority_model_idx": priority_model_idx,
        "compiler_args": compiler_args,
        "compiler_workdir": str(compiler_workdir),
        "checkpoint_path": str(checkpoint_path),
        "neuron_config": settings,
        "replica_logic": layout,
    }
    _append("builds.jsonl", record)
    if dry_run:
        return None  # the real one stops after the trace
    if tp_degree == 1:
        return StandinProgram(module.eval(), example_inputs[0], tp_degree, str(compiler_workdir), logical_nc_config)
    ranks = Ranks.of(tp_degree, logical_nc_config)
    number = ranks.programs
    ranks.programs += 1
    ranks.ask([("build", number, module_cls, module_init_kwargs)] * tp_degree)
    ranks.ask([("load", number, own, f"checkpoint {checkpoint_path}") for own in sharded])
    return StandinProgram(None, example_inputs[0], tp_degree, str(compiler_workdir), logical_nc_config, ranks, number)


# -- what the plugin calls of NxD, recorded ----------------------------------------------------


def _plain(value: Any) -> Any:
    """``value`` as JSON: plain values as they are, a tensor as its [shape, dtype], a sequence
    element by element, anything else by its type's name."""
    if isinstance(value, torch.Tensor):
        return [list(value.shape), str(value.dtype)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return type(value).__name__


def _spy(owner: Any, name: str, label: str) -> None:
    """``owner.name`` replaced by a function that records each call (the caller, the arguments
    as given and as bound to the real signature) and calls the real one."""
    real = getattr(owner, name)
    if getattr(real, "standin_spy", False):
        return
    signature = inspect.signature(real)

    @functools.wraps(real)
    def spy(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)  # a call the real one refuses is refused here too
        frame = sys._getframe(1)
        _append(
            "nxd_calls.jsonl",
            {
                "call": label,
                "caller": f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}",
                "positional": len(args),
                "keywords": sorted(kwargs),
                "arguments": {k: _plain(v) for k, v in bound.arguments.items() if k != "self"},
            },
        )
        return real(*args, **kwargs)

    spy.standin_spy = True
    setattr(owner, name, spy)


def record_nxd_calls() -> None:
    """Record every call of NxD's ``ModelBuilder(...)``, ``ModelBuilder.add`` and
    ``parallel_state.initialize_model_parallel`` made through those names (the plugin's, this
    builder's, ModelBuilder's own) in ``nxd_calls.jsonl``. Idempotent."""
    from pytest_layerparity.ports import standins

    standins.install()  # what the plugin does before it imports NxD
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.trace.model_builder import ModelBuilder

    _spy(parallel_state, "initialize_model_parallel", "initialize_model_parallel")
    _spy(ModelBuilder, "__init__", "ModelBuilder")
    _spy(ModelBuilder, "add", "ModelBuilder.add")


def recorded(builder: Any) -> Any:
    """``builder`` recording how it was called (``nxd_calls.jsonl``: positional count and keyword
    names, to be bound to the real ``build_module``'s signature)."""

    @functools.wraps(builder)
    def call(*args: Any, **kwargs: Any) -> Any:
        record = {"call": "build_module", "caller": "", "positional": len(args), "keywords": sorted(kwargs)}
        _append("nxd_calls.jsonl", {**record, "arguments": {}})
        return builder(*args, **kwargs)

    return call


def pytest_layerparity_nxdi_build_module(settings: Any):
    record_nxd_calls()
    return recorded(build_module)
