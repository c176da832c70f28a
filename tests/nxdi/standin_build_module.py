"""A CPU stand-in for neuronx-distributed-inference's ``utils.testing.build_module`` (named as
one: the real one traces with NxD's ModelBuilder and compiles with neuronx-cc, which cannot run
here). What it keeps of the real contract, so that the plugin's ``--port nxdi --target neuron``
wiring is tested against it:

- the arguments: ``example_inputs`` a list of exactly one tuple of tensors, the module class
  and its init kwargs, ``checkpoint_path`` loaded with ``checkpoint_loader_fn`` (torch.load) and
  sharded with NxD's ``get_sharded_checkpoint`` into the module built from them (every
  parameter must come from the checkpoint, as ModelBuilder's weight loading needs);
- the process group: like ModelBuilder's trace it sets up its own (a world of ``tp_degree``)
  and ``parallel_state`` to build the module and destroys both before returning, so a process
  group the caller left set up makes it fail the way the real one does (torch refuses a second
  default group);
- the compiled program: called with tensors of exactly the example's shapes and dtypes (a NEFF
  takes nothing else), on host tensors, returning a tuple of host tensors;
- its weights: NxD's weight API of the model ModelBuilder builds (``trace/spmd.py``: the traced
  ``NxDModelExecutor``'s ``nxd_model``), ``nxd_model.initialize(sharded_checkpoint,
  start_rank_tensor)``: a list of one state dict per rank (``local_ranks_size`` of them) and
  the first rank as a tensor, loaded strictly (a missing or unexpected name, or a shape that
  differs, is an error), with the build's one exception: a ``rank_util.rank`` the application's
  converter leaves out (NxD's SPMDRank, which Mixtral's converter gives the model only; at
  ``tp_degree`` 1 the module's own value is the rank). ModelBuilder's model has no
  ``replace_weights`` (that is ModelBuilderV2's NxDModel), so neither has this one.

Only ``tp_degree`` 1 is built (NxD's CPU mode in one process). Each build is recorded, one JSON
line in ``builds.jsonl`` in the working directory: what the plugin passed; each weight load one
line in ``loads.jsonl``: the program's workdir and what was loaded.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


@contextmanager
def world(tp_degree: int):
    from neuronx_distributed.parallel_layers import parallel_state

    before = os.environ.get("NXD_CPU_MODE")
    os.environ["NXD_CPU_MODE"] = "1"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=tp_degree)
    try:
        parallel_state.initialize_model_parallel(tp_degree, 1, expert_model_parallel_size=1, skip_collective_init=True)
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


class StandinNxDModel:
    """``nxd_model`` of the built program: NxD's ``NxDModel.initialize`` (trace/spmd.py)."""

    def __init__(self, program: StandinProgram, workdir: str) -> None:
        self.program = program
        self.workdir = workdir

    def initialize(self, checkpoint: list[dict[str, torch.Tensor]], start_rank_tensor: torch.Tensor) -> None:
        if not isinstance(start_rank_tensor, torch.Tensor) or start_rank_tensor.numel() != 1:
            raise TypeError("initialize takes the start rank as a one-element tensor")
        if not (
            isinstance(checkpoint, list)
            and all(isinstance(d, dict) and all(isinstance(t, torch.Tensor) for t in d.values()) for d in checkpoint)
        ):
            raise TypeError("initialize takes a list of state dicts (one per rank)")
        if len(checkpoint) != self.program.tp_degree:
            raise ValueError(f"initialize: {len(checkpoint)} state dicts for {self.program.tp_degree} ranks")
        start = int(start_rank_tensor)
        # one process, one rank: the list's first state dict is rank start's
        missing, unexpected = self.program.module.load_state_dict(checkpoint[0], strict=False)
        missing = [k for k in missing if not k.endswith("rank_util.rank")]  # as the build: see build_module
        if missing or unexpected:
            raise RuntimeError(f"initialize: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        record = {"workdir": self.workdir, "ranks": len(checkpoint), "start_rank": start, "names": len(checkpoint[0])}
        with open("loads.jsonl", "a") as sink:
            sink.write(json.dumps(record) + "\n")


class StandinProgram:
    def __init__(
        self, module: torch.nn.Module, example: tuple[torch.Tensor, ...], tp_degree: int, workdir: str
    ) -> None:
        self.module = module
        self.signature = [(tuple(t.shape), t.dtype) for t in example]
        self.tp_degree = tp_degree
        self.nxd_model = StandinNxDModel(self, workdir)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        given = [(tuple(t.shape), t.dtype) for t in inputs]
        if given != self.signature:
            raise ValueError(f"the compiled program takes {self.signature}, was given {given}")
        if any(t.device.type != "cpu" for t in inputs):
            raise ValueError("the compiled program takes host tensors")
        with world(self.tp_degree), torch.no_grad():
            outputs = self.module(*inputs)
        return tuple(t.detach().clone() for t in outputs)


def build_module(
    module_cls,
    example_inputs,
    module_init_kwargs=None,
    tp_degree=1,
    world_size=None,
    local_ranks_size=None,
    compiler_args=None,
    compiler_workdir=None,
    checkpoint_path=None,
    priority_model_idx=0,
    logical_nc_config=1,
    dry_run=False,
    checkpoint_loader_fn=torch.load,
):
    from neuronx_distributed.trace.trace import get_sharded_checkpoint

    if not (
        isinstance(example_inputs, list)
        and len(example_inputs) == 1
        and isinstance(example_inputs[0], tuple)
        and all(isinstance(t, torch.Tensor) for t in example_inputs[0])
    ):
        raise ValueError("example_inputs must be a list of exactly one tuple of tensors")
    if tp_degree != 1:
        raise NotImplementedError("the CPU stand-in of build_module builds tp_degree 1 only")
    if checkpoint_path is None or not Path(checkpoint_path).exists():
        raise FileNotFoundError(f"checkpoint_path {checkpoint_path}: the stand-in does not make random weights")
    workdir = Path(compiler_workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "compiler_args.txt").write_text(compiler_args or "")
    with world(tp_degree):
        module = module_cls(**(module_init_kwargs or {}))
        state = checkpoint_loader_fn(checkpoint_path)
        get_sharded_checkpoint(state, module, 0, tp_degree)
        missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("rank_util.rank")]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {checkpoint_path}: missing {missing}, unexpected {unexpected}")
    record = {
        "module": module_cls.__name__,
        "init": sorted(module_init_kwargs or {}),
        "index": (module_init_kwargs or {}).get("index"),
        "example": [[list(t.shape), str(t.dtype)] for t in example_inputs[0]],
        "tp_degree": tp_degree,
        "world_size": world_size,
        "local_ranks_size": local_ranks_size,
        "logical_nc_config": logical_nc_config,
        "compiler_args": compiler_args,
        "compiler_workdir": str(compiler_workdir),
        "checkpoint_path": str(checkpoint_path),
    }
    with open("builds.jsonl", "a") as sink:
        sink.write(json.dumps(record) + "\n")
    return StandinProgram(module.eval(), example_inputs[0], tp_degree, str(compiler_workdir))


def pytest_layerparity_nxdi_build_module(settings: Any):
    return build_module
