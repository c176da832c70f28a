"""The base of the per-op tools (:class:`_OpTool`, a TorchDispatchMode): which ops are
checked, the step window, the ranks, logging to the logger and to a file, failure records
(:class:`OpFailure`) and dumps. The tools: :mod:`._compare_with_cpu`, :mod:`._nan_inf`."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
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
