"""Replaying one dumped op: ``compare_for_single_op`` / ``nan_inf_track_for_single_op``."""

from __future__ import annotations

import logging
from typing import Any

import torch

from . import _compare as C
from ._compare_with_cpu import OpRun, compare_op_results
from ._dump import load_op_dump
from ._format import describe_tensor, format_failure_block, nan_inf_counts
from ._names import op_display_name, resolve_op
from ._tool import logger

__all__ = ["compare_for_single_op", "nan_inf_track_for_single_op", "replay_device"]


def replay_device(device: str) -> torch.device:
    """The device to replay an op saved from ``device`` on: the same device
    type when it is available here, else the CPU."""
    d = torch.device(device)
    cpu = torch.device("cpu")
    if d.type == "cpu":
        return cpu
    if d.type == "xla":
        try:
            import torch_xla

            return torch_xla.device()
        except Exception:
            return cpu
    if d.type == "cuda":
        if torch.cuda.is_available():
            idx = d.index if d.index is not None and d.index < torch.cuda.device_count() else 0
            return torch.device("cuda", idx)
        return cpu
    mod = getattr(torch, d.type, None)
    try:
        if mod is not None and mod.is_available():
            return torch.device(d.type, d.index or 0)
    except Exception:
        pass
    return cpu


def _load(path: str, op: Any, device: str | None):
    values, info, devs = load_op_dump(path, with_devices=True)
    if info.get("kind") not in (None, "inputs"):
        raise ValueError(f"{path} holds an op's {info.get('kind')}, not its inputs")
    saved_op = info.get("op")
    func = resolve_op(op if op is not None else saved_op)
    # an OpOverloadPacket given by the caller: use the saved overload when it is the same op
    if not hasattr(func, "_schema") and hasattr(func, "_qualified_op_name") and saved_op:
        name, _, overload = saved_op.partition(".")
        if name == func._qualified_op_name and overload:
            func = getattr(func, overload, func)
    target = torch.device(device) if device is not None else replay_device(info.get("device", "cpu"))

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(target) if devs.get(id(x), "cpu") != "cpu" else x
        if isinstance(x, torch.device) and x.type != "cpu":
            return target
        return x

    args = tuple(C.tree_map(move, values.get("args", [])))
    kwargs = C.tree_map(move, values.get("kwargs", {}))
    return func, args, kwargs, target, info


def compare_for_single_op(
    path: str, op: Any = None, atol: float = 0.001, rtol: float = 0.001, *, device: str | None = None
):
    """Replay a dumped op (``<dir>/torch.ops.aten.addmm_inputs.safetensors``)
    on its original device type if available here (else the CPU, or
    ``device``), run it again on the CPU, and compare.

    ``op`` is a callable (``torch.ops.aten.addmm``) or a name
    (``'torch.ops.aten.addmm'``); ``None`` uses the op named in the dump.
    Returns ``(correct, args, kwargs, out)``: the replayed inputs and output
    (on the replay device).  The result is logged like ``CompareWithCPU``.
    """
    func, args, kwargs, _target, _info = _load(path, op, device)
    name = op_display_name(func)
    written = C.written_args(func)
    args_cpu, kwargs_cpu, _ = C.cpu_inputs(args, kwargs, written)
    out = func(*args, **kwargs)
    out_cpu, used_args, used_kwargs, upcast_err = C.run_on_cpu(func, args_cpu, kwargs_cpu)
    notes = [upcast_err, "Convert to float32 ..."] if upcast_err else []
    dev_label = C.device_label(args, kwargs, out)
    mismatches = compare_op_results(
        OpRun(out, args, kwargs), OpRun(out_cpu, used_args, used_kwargs), written, dev_label, atol, rtol
    )
    if mismatches:
        logger.error(format_failure_block(name, "CompareWithCPU", args, kwargs, out, mismatches, notes))
    else:
        if notes:
            logger.info("\n".join(notes))
        logger.info(f"{name} succeeds to pass CompareWithCPU test")
    return not mismatches, args, kwargs, out


def nan_inf_track_for_single_op(path: str, op: Any = None, *, device: str | None = None):
    """Replay a dumped op on its device (see :func:`compare_for_single_op`) and
    check its outputs for NaN/Inf.  Returns ``(correct, args, kwargs, out)``,
    ``correct`` meaning no NaN/Inf."""
    func, args, kwargs, _target, _info = _load(path, op, device)
    name = op_display_name(func)
    out = func(*args, **kwargs)
    leaves = [(p, t) for p, t in C.tree_leaves_with_path(out) if isinstance(t, torch.Tensor)]
    C.sync_xla_if_needed([t for _, t in leaves])
    correct = True
    for p, t in leaves:
        n, i = nan_inf_counts(t.detach().to("cpu"))
        if n or i:
            correct = False
            where = "" if p == "" else f" (output {p})"
            logger.log(
                logging.WARNING,
                f"[WARNING] {name} has nan/inf{where}: nan_num={n}, inf_num={i}, {describe_tensor(t)}",
            )
    if correct:
        logger.info(f"{name} has no nan/inf")
    return correct, args, kwargs, out
