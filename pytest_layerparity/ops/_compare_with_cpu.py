"""``CompareWithCPU``: every op run again on the CPU and compared (a TorchDispatchMode)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from . import _compare as C
from ._format import format_failure_block
from ._names import op_overload_name
from ._tool import _CHECK, _UNCOMPARABLE, OpCheckError, OpFailure, _no_other_modes, _OpTool


class CompareError(OpCheckError):
    """An op's device result differs from its CPU result (dump_error_data=True)."""


class OpRun(NamedTuple):
    """One run of an op: what it returned and the arguments it ran with (on the CPU, the
    ones it was finally given: float32 copies where it was upcast)."""

    out: Any
    args: Any
    kwargs: Any


class _CpuInputs(NamedTuple):
    """The CPU copies of an op's inputs, taken before the device op ran: ``devices`` maps
    each copy (by id) to its tensor's device; ``pristine``, for a dump, clones of the copies
    where the op writes its inputs (else None)."""

    args: Any
    kwargs: Any
    devices: dict
    pristine: Any


class CompareWithCPU(_OpTool):
    """Run every aten op on its device and again on CPU copies of its inputs,
    and compare the results (``|dev - cpu| <= atol + rtol * |cpu|``).

    Usage::

        open_module_tracker(model)
        with CompareWithCPU(atol=1e-3, rtol=1e-3, verbose=True) as cmp:
            model(x)
        cmp.first_failure          # OpFailure or None

    * ``target_list`` (alias ``target_op``): compare only these ops (names
      like ``'torch.ops.aten.addmm'``, ``'aten.addmm.default'``, patterns);
      the default white list is then not applied.
    * ``white_list``: ops not compared (added to :data:`DEFAULT_WHITE_LIST`).
    * Half/BF16 ops without a CPU kernel are upcast to float32 on the CPU
      (logged as ``Convert to float32 ...``); the device result is compared
      against the float32 reference.
    * In-place/out= ops: the CPU copies of the inputs are taken before the
      device op runs; mutated inputs are compared too.
    * An op the CPU cannot run (even in float32) is logged (WARNING) and
      skipped, never fatal.
    * ``dump_error_data=True``: on the first failing op, its inputs/outputs
      are saved to ``output_dir`` (see :mod:`._dump`) and :class:`CompareError`
      is raised.
    * torch-xla: ops are lazy, so each compared op's inputs and outputs are
      materialised (``torch_xla.sync()``): one graph execution per op, which
      is slow; restrict with ``target_list`` on big models.
    * Ops whose inputs are all on the CPU are compared against a second CPU
      run (trivially equal for deterministic ops), so the tool runs on a
      CPU-only model.
    """

    tool_name = "CompareWithCPU"
    log_stem = "compare_with_cpu"

    def __init__(
        self,
        enabled: bool = True,
        atol: float = 0.001,
        rtol: float = 0.001,
        verbose: bool = False,
        target_list: Any = None,
        white_list: Any = None,
        dump_error_data: bool = False,
        output_dir: str | None = None,
        should_log_to_file: bool = False,
        enable_ranks: Iterable[int] | None = None,
        start_step: int = 0,
        end_step: int = sys.maxsize,
        target_op: Any = None,
        *,
        max_records: int = 1000,
    ):
        super().__init__(
            enabled=enabled,
            target_list=target_list,
            white_list=white_list,
            target_op=target_op,
            dump_error_data=dump_error_data,
            output_dir=output_dir,
            should_log_to_file=should_log_to_file,
            enable_ranks=enable_ranks,
            start_step=start_step,
            end_step=end_step,
            verbose=verbose,
            max_records=max_records,
        )
        self.atol = float(atol)
        self.rtol = float(rtol)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if not self._active:
            return func(*args, **kwargs)
        self._op_index += 1
        dec = self._decisions.get(func) or self._decide(func)
        if dec[0] != _CHECK:
            self._log_pass_through(func, dec[0])
            return func(*args, **kwargs)
        if not C.comparable(C.tree_tensors((args, kwargs))):
            self._log_pass_through(func, _UNCOMPARABLE)
            return func(*args, **kwargs)
        return self._compare_op(func, args, kwargs, dec[1])

    def _compare_op(self, func, args, kwargs, written):
        op_name = self._op_name(func)
        place = self._where()
        path, _, phase = place
        label = self._label(op_name, path, phase)
        if self.verbose:
            self._emit(logging.INFO, f"{label} starts to run ...")
        try:
            with _no_other_modes():
                args_cpu, kwargs_cpu, devices = C.cpu_inputs(args, kwargs, written)
            pristine = None
            if self.dump_error_data and (written[0] or written[1]):
                pristine = C.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (args_cpu, kwargs_cpu))
                for a, b in zip(C.tree_tensors((args_cpu, kwargs_cpu)), C.tree_tensors(pristine), strict=False):
                    devices[id(b)] = devices.get(id(a), "cpu")
        except Exception as e:
            self._emit(logging.WARNING, f"{label} cannot copy inputs to cpu, skip comparing: {e}")
            self._skip(label, f"copy to cpu: {e}")
            return func(*args, **kwargs)

        out = func(*args, **kwargs)  # the device op; its errors are the caller's
        device = OpRun(out, args, kwargs)
        with _no_other_modes():
            inputs = _CpuInputs(args_cpu, kwargs_cpu, devices, pristine)
            return self._check_results(func, written, device, inputs, op_name, place, label)

    def _check_results(
        self, func, written, device: OpRun, inputs: _CpuInputs, op_name: str, place: tuple[str, str, str], label: str
    ):
        """Run the op on the CPU copies of its inputs and compare; log, record and (with
        dump_error_data) dump and raise on a mismatch. ``place``: the op's module path,
        qualname and phase. Returns the device op's output."""
        out, args, kwargs = device
        path, qualname, phase = place
        self.stats["checked"] += 1
        notes: list[str] = []
        try:
            out_cpu, used_args, used_kwargs, upcast_err = C.run_on_cpu(func, inputs.args, inputs.kwargs)
        except Exception as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
            self._emit(logging.WARNING, f"{label} cannot run on cpu, skip comparing: {msg}")
            self._skip(label, f"cpu run: {msg}")
            return out
        if upcast_err is not None:
            notes = [upcast_err, "Convert to float32 ..."]
            if self.verbose:
                self._emit(logging.INFO, "\n".join(notes))
        try:
            dev_label = C.device_label(args, kwargs, out)
            cpu = OpRun(out_cpu, used_args, used_kwargs)
            mismatches = compare_op_results(device, cpu, written, dev_label, self.atol, self.rtol)
        except Exception as e:
            self._emit(logging.WARNING, f"{label} comparison failed, skipped: {e!r}")
            self._skip(label, f"compare: {e!r}")
            return out
        if not mismatches:
            self.stats["passed"] += 1
            if self.verbose:
                self._emit(logging.INFO, f"{label} succeeds to pass CompareWithCPU test")
            return out

        block = format_failure_block(
            label, self.tool_name, args, kwargs, out, mismatches, () if self.verbose else notes
        )
        m0 = mismatches[0]
        diffs = [m.max_abs_diff for m in mismatches if m.max_abs_diff is not None]
        rec = OpFailure(
            self.tool_name,
            op_name,
            op_overload_name(func),
            path,
            qualname,
            phase,
            self.step_cnt,
            self._op_index,
            dev_label,
            output=m0.where,
            max_abs_diff=max(diffs) if diffs else None,
            num_bad=m0.num_bad,
            numel=m0.numel,
            first_bad_index=m0.first_bad_index,
            cpu_upcast=upcast_err is not None,
            message=block,
        )
        self._record(rec)
        self._emit(logging.ERROR, block)
        if self.dump_error_data:
            ins = inputs.pristine if inputs.pristine is not None else (inputs.args, inputs.kwargs)
            self._dump(
                func, rec, {"args": list(ins[0]), "kwargs": ins[1]}, inputs.devices, {"out": out, "cpu_out": out_cpu}
            )
            raise CompareError(f"{label} fails to pass CompareWithCPU test (inputs saved to {rec.dump_path})", rec)
        return out


def compare_op_results(device: OpRun, cpu: OpRun, written, dev_label: str, atol: float, rtol: float) -> list:
    """Compare an op's device outputs (and the inputs it mutated, ``written``) with the CPU
    run's."""
    out, args, kwargs = device
    out_cpu, used_args, used_kwargs = cpu
    dev_leaves = [("output" if p == "" else f"output {p}", v) for p, v in C.tree_leaves_with_path(out)]
    cpu_leaves = [("output" if p == "" else f"output {p}", v) for p, v in C.tree_leaves_with_path(out_cpu)]
    out_ids = {id(t) for t in C.tree_tensors(out)}
    pos, names = written
    mutated = [(i, args[i], used_args[i]) for i in sorted(pos) if i < len(args)]
    mutated += [(n, kwargs[n], used_kwargs[n]) for n in sorted(names) if n in kwargs]
    for key, on_device, on_cpu in mutated:
        for (p, d), (_, c) in zip(C.tree_leaves_with_path(on_device), C.tree_leaves_with_path(on_cpu), strict=False):
            if isinstance(d, torch.Tensor) and id(d) not in out_ids:
                w = f"mutated input {key}" + (f"[{p}]" if p else "")
                dev_leaves.append((w, d))
                cpu_leaves.append((w, c))
    dev_tensors = [v for _, v in dev_leaves if isinstance(v, torch.Tensor)]
    C.sync_xla_if_needed(dev_tensors)
    with torch.no_grad():
        dev_items = [(w, v.detach().to("cpu") if isinstance(v, torch.Tensor) else v, v) for w, v in dev_leaves]
        return C.compare_values(dev_items, cpu_leaves, atol, rtol, dev_label)
