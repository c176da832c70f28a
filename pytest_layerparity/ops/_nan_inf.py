"""``NanInfTracker``: each op's outputs checked for NaN/Inf on the device (a TorchDispatchMode)."""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from . import _compare as C
from ._format import describe_tensor, nan_inf_counts
from ._names import op_overload_name
from ._tool import _CHECK, OpCheckError, OpFailure, _OpTool


class NanInfError(OpCheckError):
    """An op produced NaN/Inf (dump_error_data=True)."""


class _Call(NamedTuple):
    """An op's call as a dump saves it: its arguments and output, and ``pre``, the copies
    (positional by index, keyword by name) of the inputs it writes, taken before it ran
    (None without dump_error_data)."""

    args: Any
    kwargs: Any
    out: Any
    pre: tuple[dict, dict] | None


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
        call = _Call(args, kwargs, out, pre)
        if torch._C._len_torch_dispatch_stack():
            with _disable_current_modes():
                self._check_out(func, written, call)
        else:
            self._check_out(func, written, call)
        return out

    def _check_out(self, func, written, call: _Call) -> None:
        args, kwargs, out = call.args, call.kwargs, call.out
        if type(out) is torch.Tensor:
            found = self._probe(func, out, "output", call)
        else:
            found = False
            for p, v in C.tree_leaves_with_path(out):
                if isinstance(v, torch.Tensor):
                    found |= self._probe(func, v, "output" if p == "" else f"output {p}", call)
        if written[0] or written[1]:
            out_ids = {id(t) for t in C.tree_tensors(out)}
            for i in written[0]:
                if i < len(args):
                    for t in C.tree_tensors(args[i]):
                        if id(t) not in out_ids:
                            found |= self._probe(func, t, f"mutated input {i}", call)
            for n in written[1]:
                if n in kwargs:
                    for t in C.tree_tensors(kwargs[n]):
                        if id(t) not in out_ids:
                            found |= self._probe(func, t, f"mutated input {n}", call)
        if not found and self.verbose:
            path, _, phase = self._where()
            self._emit(logging.INFO, f"{self._label(self._op_name(func), path, phase)} has no nan/inf")

    # ----------------------------------------------------------- checks ----
    def _probe(self, func, t: torch.Tensor, where: str, call: _Call) -> bool:
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
            self._report(func, t, where, self._where(), self.step_cnt, self._op_index, call=call)
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
            self._report(func, t, where, place, step, op_index, device)

    def _report(self, func, t, where, place, step, op_index, device=None, call: _Call | None = None) -> None:
        """Log and record op ``func``'s NaN/Inf in ``t`` (its ``where``: output, mutated
        input); with ``call`` (a check at once) and dump_error_data, dump it and raise."""
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
                nan_n, inf_n = nan_inf_counts(tc)
                bad = ~torch.isfinite(tc).reshape(-1)
                j = bad.nonzero().reshape(-1)[:1]
                if len(j):
                    first = tuple(int(c[0]) for c in torch.unravel_index(j, tc.shape)) if tc.dim() else ()
                numel = tc.numel()
                desc = f", first at index {first}, {describe_tensor(t)}"
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
        if self.dump_error_data and call is not None:
            pre_pos, pre_kw = call.pre if call.pre is not None else ({}, {})
            ins_args = [pre_pos.get(i, a) for i, a in enumerate(call.args)]
            ins_kwargs = {n: pre_kw.get(n, v) for n, v in call.kwargs.items()}
            self._dump(func, rec, {"args": ins_args, "kwargs": ins_kwargs}, {}, {"out": call.out})
            raise NanInfError(f"{label} has nan/inf (inputs saved to {rec.dump_path})", rec)
