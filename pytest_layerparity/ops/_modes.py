"""``CompareWithCPU`` and ``NanInfTracker`` (TorchDispatchModes)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from . import _compare as C
from ._dump import dump_paths, save_op_dump
from ._names import OpMatcher, is_default_white_listed, op_display_name, op_overload_name
from ._tracker import ModuleInfo

logger = logging.getLogger("pytest_layerparity.ops")

_CHECK, _WHITE, _NOT_TARGET, _UNCOMPARABLE = 0, 1, 2, 3
_DECISION_CACHES: dict[tuple, dict[Any, tuple]] = {}
_NAMES: dict[Any, str] = {}


def _no_other_modes():
    """Our own ops (copies, CPU re-runs, probes) run with this mode already
    popped (that is how ``__torch_dispatch__`` is called); when other modes
    sit below it on the stack (e.g. NanInfTracker inside CompareWithCPU),
    they are popped too so that they do not see our bookkeeping."""
    if torch._C._len_torch_dispatch_stack():
        return _disable_current_modes()
    return contextlib.nullcontext()


def get_rank() -> int:
    """torch.distributed rank if initialised, else env ``RANK``, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


@dataclass
class OpFailure:
    """One op that failed a check.  ``label`` is the log's
    ``<module path>/torch.ops.<ns>.<op>(<phase>)``."""

    tool: str  # 'CompareWithCPU' | 'NanInfTracker'
    op_name: str  # 'torch.ops.aten.addmm'
    overload: str  # 'aten::addmm.default'
    module_path: str  # 'DecoderLayer/Attention/Linear' ('' when untracked)
    module_qualname: str  # 'attn.q_proj' (dotted path of the innermost module)
    phase: str  # 'forward' | 'backward'
    step: int
    op_index: int  # 1-based index among the ops the tool saw in this step
    device: str  # 'xla:0', 'cuda:0', 'cpu'
    output: str = "output"  # which value failed: 'output', 'output 1', 'mutated input 0'
    max_abs_diff: float | None = None
    num_bad: int = 0  # mismatching (or non-finite) elements
    numel: int = 0
    first_bad_index: tuple | None = None
    nan_count: int | None = None
    inf_count: int | None = None
    cpu_upcast: bool = False  # CPU reference computed in float32
    message: str = ""  # the logged block
    dump_path: str | None = None
    dump_outputs_path: str | None = None

    @property
    def label(self) -> str:
        return (
            f"{self.module_path}/{self.op_name}({self.phase})" if self.module_path else f"{self.op_name}({self.phase})"
        )


class OpCheckError(RuntimeError):
    """Base of the errors raised with ``dump_error_data=True``; ``.record`` is the OpFailure."""

    def __init__(self, message: str, record: OpFailure):
        super().__init__(message)
        self.record = record


class CompareError(OpCheckError):
    """An op's device result differs from its CPU result (dump_error_data=True)."""


class NanInfError(OpCheckError):
    """An op produced NaN/Inf (dump_error_data=True)."""


class _OpTool(TorchDispatchMode):
    tool_name = "?"
    log_stem = "?"
    _nan_inf_defaults = False

    def __init__(
        self,
        *,
        enabled: bool,
        target_list: Any,
        white_list: Any,
        target_op: Any,
        dump_error_data: bool,
        output_dir: str | None,
        should_log_to_file: bool,
        enable_ranks: Iterable[int] | None,
        start_step: int,
        end_step: int,
        verbose: bool,
        max_records: int,
    ):
        super().__init__()
        self.enabled = bool(enabled)
        targets = list(target_list or []) + list(target_op or [])
        self.target_list = targets
        self.white_list = list(white_list or [])
        self._target = OpMatcher(targets)
        self._user_white = OpMatcher(self.white_list)
        self.dump_error_data = bool(dump_error_data)
        self.output_dir = output_dir if output_dir is not None else os.getcwd()
        self.should_log_to_file = bool(should_log_to_file)
        self.rank = get_rank()
        self.enable_ranks = None if enable_ranks is None else [int(r) for r in enable_ranks]
        self.rank_enabled = self.enable_ranks is None or self.rank in self.enable_ranks
        self.start_step = int(start_step)
        self.end_step = int(end_step)
        self.step_cnt = 0
        self.verbose = bool(verbose)
        self.max_records = int(max_records)
        self.failures: list[OpFailure] = []
        self.skipped: list[str] = []  # labels of ops that could not be checked (and why)
        self.stats = {"checked": 0, "passed": 0, "failed": 0, "white_listed": 0, "not_target": 0, "skipped": 0}
        self.log_path = (
            os.path.join(self.output_dir, f"{self.log_stem}_rank{self.rank}.log") if self.should_log_to_file else None
        )
        self._file = None
        self._file_opened_once = False
        self._tmp_handler: logging.Handler | None = None
        self._old_level = logging.NOTSET
        self._entered = False
        self._active = False
        self._op_index = 0
        # op -> (decision, written args); shared by tools with the same lists
        key = (type(self).__name__, tuple(self._target.entries), tuple(self._user_white.entries))
        self._decisions: dict[Any, tuple] = _DECISION_CACHES.setdefault(key, {})
        self._names = _NAMES

    # ------------------------------------------------------------ state ----
    @property
    def active(self) -> bool:
        """Whether ops are checked right now (enabled, this rank, inside the step window)."""
        return self.enabled and self.rank_enabled and self._entered and self.start_step <= self.step_cnt < self.end_step

    @property
    def first_failure(self) -> OpFailure | None:
        return self.failures[0] if self.failures else None

    def _refresh(self) -> None:
        self._active = self.active

    def step(self) -> None:
        """Advance ``step_cnt``; checks run only while start_step <= step_cnt < end_step."""
        self._flush()
        self.step_cnt += 1
        self._op_index = 0
        self._refresh()
        if self._active:
            self._log_step_header()

    def __enter__(self):
        if not (self.enabled and self.rank_enabled):
            return self
        if self._entered:
            raise RuntimeError(f"{self.tool_name} is already active")
        self._open_file()
        if self.verbose and not logger.hasHandlers():
            # verbose output must show even when logging is not configured
            self._tmp_handler = logging.StreamHandler(sys.stderr)
            self._tmp_handler.setFormatter(logging.Formatter("%(message)s"))
            self._old_level = logger.level
            logger.addHandler(self._tmp_handler)
            logger.setLevel(logging.INFO)
        super().__enter__()
        self._entered = True
        self._refresh()
        if self._active:
            self._log_step_header()
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        if not self._entered:
            return None
        self._entered = False
        self._active = False
        try:
            super().__exit__(exc_type, exc_val, exc_tb)
            self._flush()
        finally:
            self._close_file()
            if self._tmp_handler is not None:
                logger.removeHandler(self._tmp_handler)
                logger.setLevel(self._old_level)
                self._tmp_handler = None
        return None

    def _flush(self) -> None:
        """Deferred checks (NanInfTracker on non-CPU devices) are resolved here."""

    # ---------------------------------------------------------- logging ----
    def _open_file(self) -> None:
        if self.log_path is None:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        self._file = open(self.log_path, "a" if self._file_opened_once else "w", encoding="utf-8")  # noqa: SIM115
        self._file_opened_once = True

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _emit(self, level: int, msg: str) -> None:
        logger.log(level, msg)
        if self._file is not None:
            self._file.write(msg + "\n")
            if level >= logging.WARNING:
                self._file.flush()

    def _log_step_header(self) -> None:
        self._emit(logging.INFO, time.strftime("%Y-%m-%d, %H:%M:%S"))
        self._emit(logging.INFO, f"-------------------------  step = {self.step_cnt}  ----------------------")

    # ------------------------------------------------------------ names ----
    def _decide(self, func: Any) -> tuple:
        if self._target and func not in self._target:
            d = _NOT_TARGET
        elif func in self._user_white or (not self._target and is_default_white_listed(func, self._nan_inf_defaults)):
            d = _WHITE
        else:
            d = _CHECK
        res = (d, C.written_args(func))
        self._decisions[func] = res
        return res

    def _op_name(self, func: Any) -> str:
        n = self._names.get(func)
        if n is None:
            n = self._names[func] = op_display_name(func)
        return n

    @staticmethod
    def _where() -> tuple[str, str, str]:
        st = ModuleInfo.current_stack()
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        if st:
            return st[-1].path, st[-1].qualname, phase
        return "", "", phase

    @staticmethod
    def _label(op_name: str, path: str, phase: str) -> str:
        return f"{path}/{op_name}({phase})" if path else f"{op_name}({phase})"

    def _log_pass_through(self, func: Any, d: int) -> None:
        if d == _WHITE:
            self.stats["white_listed"] += 1
        elif d == _NOT_TARGET:
            self.stats["not_target"] += 1
        if self.verbose:
            path, _, phase = self._where()
            label = self._label(self._op_name(func), path, phase)
            what = {_WHITE: "is in white_list, pass", _NOT_TARGET: "is not in target_list, pass"}.get(
                d, "cannot be checked (not a plain strided tensor), pass"
            )
            self._emit(logging.INFO, f"{label} {what}")

    def _record(self, rec: OpFailure) -> None:
        self.stats["failed"] += 1
        if len(self.failures) < self.max_records:
            self.failures.append(rec)

    def _skip(self, label: str, why: str) -> None:
        self.stats["skipped"] += 1
        if len(self.skipped) < self.max_records:
            self.skipped.append(f"{label}: {why}")

    def _dump(self, func: Any, rec: OpFailure, inputs: dict, devices: dict, outputs: dict) -> None:
        info = {
            "op": op_overload_name(func),
            "op_name": rec.op_name,
            "tool": self.tool_name,
            "device": rec.device,
            "module_path": rec.module_path,
            "module_qualname": rec.module_qualname,
            "phase": rec.phase,
            "step": rec.step,
        }
        if hasattr(self, "atol"):
            info.update(atol=self.atol, rtol=self.rtol)
        in_path, out_path = dump_paths(self.output_dir, rec.op_name)
        save_op_dump(in_path, inputs, {**info, "kind": "inputs"}, devices)
        save_op_dump(out_path, outputs, {**info, "kind": "outputs"})
        rec.dump_path, rec.dump_outputs_path = in_path, out_path
        self._emit(logging.ERROR, f"{rec.label}: inputs saved to {in_path}, outputs saved to {out_path}")


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
        path, qualname, phase = self._where()
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
        with _no_other_modes():
            return self._check_results(
                func,
                args,
                kwargs,
                written,
                out,
                args_cpu,
                kwargs_cpu,
                devices,
                pristine,
                op_name,
                path,
                qualname,
                phase,
                label,
            )

    def _check_results(
        self,
        func,
        args,
        kwargs,
        written,
        out,
        args_cpu,
        kwargs_cpu,
        devices,
        pristine,
        op_name,
        path,
        qualname,
        phase,
        label,
    ):
        self.stats["checked"] += 1
        notes: list[str] = []
        try:
            out_cpu, used_args, used_kwargs, upcast_err = C.run_on_cpu(func, args_cpu, kwargs_cpu)
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
            mismatches = self._compare_outputs(out, out_cpu, args, kwargs, used_args, used_kwargs, written, dev_label)
        except Exception as e:
            self._emit(logging.WARNING, f"{label} comparison failed, skipped: {e!r}")
            self._skip(label, f"compare: {e!r}")
            return out
        if not mismatches:
            self.stats["passed"] += 1
            if self.verbose:
                self._emit(logging.INFO, f"{label} succeeds to pass CompareWithCPU test")
            return out

        block = C.format_failure_block(
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
            ins = pristine if pristine is not None else (args_cpu, kwargs_cpu)
            self._dump(func, rec, {"args": list(ins[0]), "kwargs": ins[1]}, devices, {"out": out, "cpu_out": out_cpu})
            raise CompareError(f"{label} fails to pass CompareWithCPU test (inputs saved to {rec.dump_path})", rec)
        return out

    def _compare_outputs(self, out, out_cpu, args, kwargs, used_args, used_kwargs, written, dev_label):
        return compare_op_results(
            out, out_cpu, args, kwargs, used_args, used_kwargs, written, dev_label, self.atol, self.rtol
        )


def compare_op_results(out, out_cpu, args, kwargs, used_args, used_kwargs, written, dev_label, atol, rtol) -> list:
    """Compare an op's device outputs (and the inputs it mutated) with the CPU run's."""
    dev_leaves = [("output" if p == "" else f"output {p}", v) for p, v in C.tree_leaves_with_path(out)]
    cpu_leaves = [("output" if p == "" else f"output {p}", v) for p, v in C.tree_leaves_with_path(out_cpu)]
    out_ids = {id(t) for t in C.tree_tensors(out)}
    pos, names = written
    for i in sorted(pos):
        if i < len(args):
            for (p, d), (_, c) in zip(
                C.tree_leaves_with_path(args[i]), C.tree_leaves_with_path(used_args[i]), strict=False
            ):
                if isinstance(d, torch.Tensor) and id(d) not in out_ids:
                    w = f"mutated input {i}" + (f"[{p}]" if p else "")
                    dev_leaves.append((w, d))
                    cpu_leaves.append((w, c))
    for n in sorted(names):
        if n in kwargs:
            for (p, d), (_, c) in zip(
                C.tree_leaves_with_path(kwargs[n]), C.tree_leaves_with_path(used_kwargs[n]), strict=False
            ):
                if isinstance(d, torch.Tensor) and id(d) not in out_ids:
                    w = f"mutated input {n}" + (f"[{p}]" if p else "")
                    dev_leaves.append((w, d))
                    cpu_leaves.append((w, c))
    dev_tensors = [v for _, v in dev_leaves if isinstance(v, torch.Tensor)]
    C.sync_xla_if_needed(dev_tensors)
    with torch.no_grad():
        dev_items = [(w, v.detach().to("cpu") if isinstance(v, torch.Tensor) else v, v) for w, v in dev_leaves]
        return C.compare_values(dev_items, cpu_leaves, atol, rtol, dev_label)


_FLOATING = frozenset(
    d
    for d in (getattr(torch, n, None) for n in dir(torch))
    if isinstance(d, torch.dtype) and (d.is_floating_point or d.is_complex)
)


class NanInfTracker(_OpTool):
    """Report ops whose outputs (or mutated inputs) contain NaN/Inf, on the
    device, without a CPU re-run.

    Each checked floating output gets one reduction (a sum: NaN/Inf anywhere
    makes the sum non-finite; a non-finite sum of finite values, i.e. an
    overflow, is ruled out by an exact ``isfinite`` check before reporting).

    * CPU outputs are checked at once (``.item()`` of the sum is free there).
    * Other devices (cuda, xla, ...) are checked lazily by default
      (``deferred=None``): the per-op sums (float64, exact) are kept on the
      device and checked together at ``step()``, at exit, every
      ``flush_every`` ops, or by :meth:`check`, so there is no per-op host
      sync (on torch-xla no extra graph execution per op).  The first
      offending op is still named (order is kept); the NaN/Inf counts are
      given when the tensor is still alive.
    * ``dump_error_data=True`` forces immediate checks: on the first offending
      op its inputs/outputs are saved and :class:`NanInfError` is raised.

    Log lines: ``[WARNING] <path>/torch.ops.aten.log(forward) has nan/inf in
    output: nan_num=.., inf_num=.., first at index (..), Tensor <...>``.
    ``first_failure`` (alias ``first_nan_inf``) holds the first offending op.
    """

    tool_name = "NanInfTracker"
    log_stem = "nan_inf_tracker"
    _nan_inf_defaults = True

    def __init__(
        self,
        enabled: bool = True,
        target_list: Any = None,
        white_list: Any = None,
        should_log_to_file: bool = False,
        output_dir: str | None = None,
        enable_ranks: Iterable[int] | None = None,
        start_step: int = 0,
        end_step: int = sys.maxsize,
        dump_error_data: bool = False,
        *,
        target_op: Any = None,
        verbose: bool = False,
        deferred: bool | None = None,
        flush_every: int = 4096,
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
        # dump_error_data needs the offending op's inputs at hand: check at once
        self.deferred = False if dump_error_data else deferred
        self.flush_every = int(flush_every)
        self._pending: list[tuple] = []
        self._no_f64: set[str] = set()

    @property
    def first_nan_inf(self) -> OpFailure | None:
        return self.first_failure

    def check(self) -> OpFailure | None:
        """Resolve deferred checks now; returns ``first_failure``."""
        with _disable_current_modes():  # our own ops must not be intercepted
            self._flush()
        return self.first_failure

    def step(self) -> None:
        self.check()
        super().step()

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
        written = dec[1]
        pre = None
        if self.dump_error_data and (written[0] or written[1]):
            # pre-op copies of the inputs the op writes (for the dump)
            clone = lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
            pre = (
                {i: C.tree_map(clone, args[i]) for i in written[0] if i < len(args)},
                {n: C.tree_map(clone, kwargs[n]) for n in written[1] if n in kwargs},
            )
        out = func(*args, **kwargs)
        self.stats["checked"] += 1
        if torch._C._len_torch_dispatch_stack():
            with _disable_current_modes():
                self._check_out(func, args, kwargs, out, written, pre)
        else:
            self._check_out(func, args, kwargs, out, written, pre)
        return out

    def _check_out(self, func, args, kwargs, out, written, pre) -> None:
        if type(out) is torch.Tensor:
            found = self._probe(func, out, "output", args, kwargs, out, pre)
        else:
            found = False
            for p, v in C.tree_leaves_with_path(out):
                if isinstance(v, torch.Tensor):
                    found |= self._probe(func, v, "output" if p == "" else f"output {p}", args, kwargs, out, pre)
        if written[0] or written[1]:
            out_ids = {id(t) for t in C.tree_tensors(out)}
            for i in written[0]:
                if i < len(args):
                    for t in C.tree_tensors(args[i]):
                        if id(t) not in out_ids:
                            found |= self._probe(func, t, f"mutated input {i}", args, kwargs, out, pre)
            for n in written[1]:
                if n in kwargs:
                    for t in C.tree_tensors(kwargs[n]):
                        if id(t) not in out_ids:
                            found |= self._probe(func, t, f"mutated input {n}", args, kwargs, out, pre)
        if not found and self.verbose:
            path, _, phase = self._where()
            self._emit(logging.INFO, f"{self._label(self._op_name(func), path, phase)} has no nan/inf")

    # ----------------------------------------------------------- checks ----
    def _probe(self, func, t: torch.Tensor, where: str, args, kwargs, out, pre) -> bool:
        dt = t.dtype
        if dt not in _FLOATING:
            return False
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return False
        if t.is_meta or t.layout != torch.strided or t.numel() == 0:
            return False
        deferred = self.deferred if self.deferred is not None else not t.is_cpu
        if not deferred:
            try:
                if dt is torch.float32 or dt is torch.bfloat16 or dt is torch.float64:
                    s = t.sum()
                elif dt == torch.float16:
                    s = t.sum(dtype=torch.float32)
                elif dt.is_complex:
                    s = torch.view_as_real(t.resolve_conj()).sum(dtype=torch.float64)
                else:
                    s = t.float().sum()
                v = s.item()
            except Exception as e:
                self._skip(self._op_name(func), f"nan/inf probe: {e!r}")
                return False
            if v - v == 0:  # finite
                return False
            if bool(torch.isfinite(t).all()):  # the sum overflowed
                return False
            self._flush()  # earlier deferred ops come first
            self._report(func, t, where, self._where(), self.step_cnt, self._op_index, args, kwargs, out, pre)
            return True
        # deferred: an exact float64 probe, kept on the device
        dev_type = t.device.type
        if dt == torch.float64:
            s = (t * 0).sum()
        elif dev_type in self._no_f64:
            s = (t.float() * 0).sum()
        else:
            try:
                src = torch.view_as_real(t.resolve_conj()) if dt.is_complex else t
                s = src.sum(dtype=torch.float64)
            except Exception:
                self._no_f64.add(dev_type)
                s = (t.float() * 0).sum()
        self._pending.append(
            (s, func, where, self._where(), self.step_cnt, self._op_index, weakref.ref(t), t._version, t.device)
        )
        if len(self._pending) >= self.flush_every:
            self._flush()
        return False

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        by_dev: dict[torch.device, list[int]] = {}
        for i, p in enumerate(pending):
            by_dev.setdefault(p[0].device, []).append(i)
        bad: list[int] = []
        with torch.no_grad():
            for _dev, idxs in by_dev.items():
                C.sync_xla_if_needed([pending[idxs[0]][0]])
                probes = [pending[i][0] for i in idxs]
                dt = torch.float64 if any(p.dtype == torch.float64 for p in probes) else torch.float32
                flags = torch.isfinite(torch.stack([p.to(dt) for p in probes])).to("cpu")
                bad += [idxs[j] for j in (~flags).nonzero().reshape(-1).tolist()]
        for i in sorted(bad):
            _s, func, where, place, step, op_index, ref, version, device = pending[i]
            t = ref()
            if t is not None and t._version != version:
                t = None
            self._report(func, t, where, place, step, op_index, None, None, None, None, device)

    def _report(self, func, t, where, place, step, op_index, args, kwargs, out, pre, device=None) -> None:
        path, qualname, phase = place
        op_name = self._op_name(func)
        label = self._label(op_name, path, phase)
        suffix = "" if where == "output" else f" ({where})"
        nan_n = inf_n = None
        first = None
        numel = 0
        desc = ""
        if t is not None:
            with torch.no_grad():
                tc = t.detach().to("cpu")
                nan_n, inf_n = C.nan_inf_counts(tc)
                bad = ~torch.isfinite(tc).reshape(-1)
                j = bad.nonzero().reshape(-1)[:1]
                if len(j):
                    first = tuple(int(c[0]) for c in torch.unravel_index(j, tc.shape)) if tc.dim() else ()
                numel = tc.numel()
                desc = f", first at index {first}, {C.describe_tensor(t)}"
            counts = f": nan_num={nan_n}, inf_num={inf_n}"
        else:
            counts = " (found by a deferred check; the tensor is gone, no counts)"
        msg = f"[WARNING] {label} has nan/inf{suffix}{counts}{desc}"
        dev = str(t.device if t is not None else device)
        rec = OpFailure(
            self.tool_name,
            op_name,
            op_overload_name(func),
            path,
            qualname,
            phase,
            step,
            op_index,
            dev,
            output=where,
            num_bad=(nan_n or 0) + (inf_n or 0),
            numel=numel,
            first_bad_index=first,
            nan_count=nan_n,
            inf_count=inf_n,
            message=msg,
        )
        self._record(rec)
        self._emit(logging.WARNING, msg)
        if self.dump_error_data and args is not None:
            pre_pos, pre_kw = pre if pre is not None else ({}, {})
            ins_args = [pre_pos.get(i, a) for i, a in enumerate(args)]
            ins_kwargs = {n: pre_kw.get(n, v) for n, v in kwargs.items()}
            self._dump(func, rec, {"args": ins_args, "kwargs": ins_kwargs}, {}, {"out": out})
            raise NanInfError(f"{label} has nan/inf (inputs saved to {rec.dump_path})", rec)
