"""The alternatives a perturbed run (:class:`.perturb.PerturbedArithmetic`) draws for every op
of a kind, a backend lowering all such ops one way: a variance in one pass or two, a 16-bit
layer norm in its own dtype, a 16-bit matmul's product rounded before its bias, a float32
matmul as XLA's CPU backend sums it, a fused attention as tensor cores return it or as eager
attention computes it. Each is taken by half the runs, drawn once per run and alternative."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .algorithms import (
    DECOMPOSED_OPS,
    EAGER_ATTENTION,
    OWN_DTYPE_NORM_LEAN,
    OWN_DTYPE_NORMS,
    PRODUCT_ROUNDED_ADDMM,
    WIDE_STATISTICS_NORMS,
    addmm_product,
    eager_attention,
    in_order_scores_attention,
    layer_norm_in_own_dtype,
    one_pass_var_mean,
)
from .rounding import _UNIT_ROUNDOFF
from .tensor_cores import with_tensor_core_rows
from .wider import _named_arguments, exact_fast_matmul, with_rows

#: Result dtypes whose one-row matmuls with a bias (a decode step's token times a weight, plus
#: its bias) a run may sum one product at a time from the bias, in the runs that take it (half,
#: drawn apart): XLA's CPU backend fuses a one-row dot with its bias into one loop that does so
#: (measured at K 64 to 4096: its error is that of such a sum, 3.3 times eager's at K 896; its
#: results are a fused multiply-add's at a time, bit for bit, which a run computes:
#: ``sums.fused_sequential_sum``), as torch's own CPU addmm does for one row times a (k, n)
#: row-major weight. Its one-row dot without a bias sums so from K ``IN_ORDER_FROM`` on, and in
#: blocks below it, more accurately than eager (0.35 to 0.45 times eager's error at K 1024 to
#: 4095; 0.73 to 0.97 at K 64 to 2048 on a CPU with AVX512-FP16; ``bench_xla_kernels.py --one-row``):
#: a shorter one without a bias takes no alternative. Products of more rows go to blocked
#: kernels (XLA's 4 and 32 rows err 1.1 and 1.25 times eager): taken for all of them, the
#: in-order sum widened Qwen2.5-Coder-0.5B's float32 prompt limits 6-fold. A 16-bit matmul's sum
#: in float32 is below its result's rounding (not modelled).
SEQUENTIAL_SUMS = frozenset({torch.float32})
#: The length of sum from which XLA's CPU backend sums a one-row dot without a bias in order
#: (measured: 0.35 to 0.43 times eager's error at K 3584 to 4095, 1.4 to 2.2 at 4096 to 16384,
#: as a sum in order does).
IN_ORDER_FROM = 4096
#: The matmuls of ``SEQUENTIAL_SUMS`` by packet name: the position of their rows' operand, and
#: the length of sum from which one row of them is summed in order in the other lowering (a
#: shorter one is summed as the reference sums it): any length with a bias (from the bias) and
#: batched (a decode step's attention scores and probabilities times values, per head: XLA sums
#: them in order, its scores erring 1.5-1.9 times eager's over a head of 64 to 256, as an
#: in-order sum does), ``IN_ORDER_FROM`` without.
ONE_ROW_MATMULS = {"mm": (0, IN_ORDER_FROM), "addmm": (1, 0), "bmm": (0, 0)}


class DrawnLowerings:
    """The drawn alternatives of :class:`.perturb.PerturbedArithmetic` (its ``mode``,
    ``samples``, ``_generator``, ``_perturbed`` and ``_wider_results``)."""

    def _one_pass(self, x: torch.Tensor) -> bool:
        """Whether this variance runs in one pass (half the time, drawn per op)."""
        if self.mode == "random" or not x.is_floating_point():
            return False
        return torch.rand((), generator=self._generator(x.device)).item() < 0.5

    def _variance(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A variance, in one pass or two (:meth:`_either`)."""
        x = args[0]
        if self.samples == 1 or self.mode == "random" or not x.is_floating_point() or x.dim() == 0:
            if self._one_pass(x):
                return self._one_pass_variance(func, args, kwargs)
            return self._perturbed(func, args, kwargs)
        return self._either(
            x, lambda: self._one_pass_variance(func, args, kwargs), lambda: self._perturbed(func, args, kwargs)
        )

    def _either(
        self, x: torch.Tensor, first: Callable[[], Any], second: Callable[[], Any], pick: torch.Tensor | None = None
    ) -> Any:
        """``first()`` or ``second()`` (a tensor or a tuple of them), each with probability
        1/2, drawn for each of the stacked runs (``samples``, more than one; or ``pick``, one
        boolean per run, given): each run's rows taken from its own draw's result. Where the
        result's rows are not the runs' (a reduction across them), the op's draw is the runs':
        ``second()``."""
        if pick is None:
            pick = torch.rand(self.samples, generator=self._generator(x.device), device=x.device) < 0.5
        if bool(pick.all()):
            return first()
        two = second()
        rows = x.shape[0]
        lead = two[0] if isinstance(two, tuple) else two
        if not pick.any() or rows % self.samples or lead.dim() == 0 or lead.shape[0] != rows:
            return two
        one = first()
        keep = pick.repeat_interleave(rows // self.samples)

        def choose(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.where(keep.view(rows, *([1] * (b.dim() - 1))), a, b)

        if isinstance(two, tuple):
            return tuple(choose(a, b) for a, b in zip(one, two, strict=True))
        return choose(one, two)

    def _layer_norm(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A 16-bit layer norm as its decomposition, computed in float32 as torch's kernels
        do, or (drawn) in its own dtype as XLA lowers it (:func:`layer_norm_in_own_dtype`)."""
        decomposition = DECOMPOSED_OPS[func]

        def standard() -> Any:
            with self:
                return decomposition(*args, **kwargs)

        def own() -> Any:  # a bfloat16 one's statistics are float32's: no lean beyond them
            size = 0 if args[0].dtype in WIDE_STATISTICS_NORMS else OWN_DTYPE_NORM_LEAN
            lean = self._per_run(args[0], size * _UNIT_ROUNDOFF[args[0].dtype]) if size else None
            with self:
                return layer_norm_in_own_dtype(*args, **kwargs, lean=lean)

        return self._drawn(args, OWN_DTYPE_NORMS, own, standard)

    def _per_run(self, x: torch.Tensor, size: float) -> torch.Tensor:
        """A number drawn from U(-size, size) for each of the stacked runs (float32), one per
        row of ``x``'s first dimension, shaped to broadcast over ``x``."""
        draws = (torch.rand(self.samples, generator=self._generator(x.device), device=x.device) * 2 - 1) * size
        rows = x.shape[0] if x.dim() else 1
        each = rows // self.samples if rows % self.samples == 0 else None
        per_row = draws.repeat_interleave(each) if each else draws[:1].expand(rows)
        return per_row.view(-1, *([1] * (x.dim() - 1)))

    def _addmm(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A 16-bit matmul with a bias as one kernel rounds it (once), or (drawn) with its
        product rounded (:func:`addmm_product`) before the bias is added."""
        if len(args) != 3 or kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
            return self._perturbed(func, args, kwargs)

        def rounded_first() -> Any:
            with exact_fast_matmul(func, args, kwargs):
                product = addmm_product(args[1], args[2])
            with self:
                return product + args[0]  # the bias added: a second rounding

        return self._drawn(args, PRODUCT_ROUNDED_ADDMM, rounded_first, lambda: self._perturbed(func, args, kwargs))

    def _matmul(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A matmul (``ACCUMULATING_OPS``), perturbed; a float32 one (``SEQUENTIAL_SUMS``), in
        the runs that take the other lowering (:meth:`_drawn`), as that lowering computes it: a
        one-row product (a decode step's token times a weight, or one row of each matrix of a
        batched product) with a bias, batched, or of at least ``IN_ORDER_FROM`` products with its
        error drawn as that of its products summed in order from its bias
        (:func:`.sums.accumulation_error`), a shorter one without a bias as the reference's
        kernel, any other with its error ``BLOCKED_SUM_SCALE`` times the reference kernel's."""

        def standard(exact: list[Any] | None = None) -> Any:
            if exact is None and func is torch.ops.aten.addmm.default:  # (a 16-bit one's alternative)
                return self._addmm(func, args, kwargs)
            return self._perturbed(func, args, kwargs, exact)

        floating = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        if self.mode == "random" or not floating or any(a.dtype not in SEQUENTIAL_SUMS for a in floating):
            return standard()
        rows, in_order_from = ONE_ROW_MATMULS.get(func.overloadpacket.__name__, (None, 0))
        operand = args[rows] if rows is not None else None
        one_row = operand is not None and (
            operand.shape[-2] == 1 if operand.dim() == 3 else operand.dim() == 2 and operand.shape[0] == self.samples
        )  # a run's row (a batched product: each of its matrices' one row)
        if one_row and operand.shape[-1] < in_order_from:
            return standard()  # summed in blocks by either lowering
        exact = self._wider_results(func, args, kwargs)  # once, for both ways
        return self._drawn(
            args,
            SEQUENTIAL_SUMS,
            lambda: self._perturbed(func, args, kwargs, exact, in_order=one_row, blocked=not one_row),
            lambda: standard(exact),
            key=self._matmul,
        )

    def _drawn(
        self,
        args: tuple,
        dtypes: frozenset,
        other: Callable[[], Any],
        standard: Callable[[], Any],
        key: Callable | None = None,
    ) -> Any:
        """``other()`` or ``standard()`` where every floating operand in ``args`` is of
        ``dtypes`` (else ``standard()``), chosen once per run for each alternative (``key``'s
        code, else ``other``'s): an implementation lowers every such op one way, so a run takes
        it for all of them or for none, half the runs each. The rows of the first operand with
        rows are the stacked runs'."""
        floating = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        x = next((a for a in floating if a.dim() > 1), floating[0] if floating else None)
        if self.mode == "random" or x is None or x.dim() == 0 or any(a.dtype not in dtypes for a in floating):
            return standard()
        return self._either(x, other, standard, self._pick(other if key is None else key, x.device))

    def _pick(self, alternative: Callable, device: torch.device) -> torch.Tensor:
        """Which of the stacked runs take ``alternative`` (one boolean per run, half of them
        on average): drawn once per run and alternative, for every op it applies to."""
        key = (alternative.__code__, device)
        if key not in self._picks:
            self._picks[key] = torch.rand(self.samples, generator=self._generator(device), device=device) < 0.5
        return self._picks[key]

    def _attention(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A fused attention op, perturbed; in the runs that take it (half), a float32 one as
        tensor cores return it (:func:`.tensor_cores.with_tensor_core_rows`), and in the runs
        that take that (half, drawn apart) a 16-bit one as transformers' eager attention
        computes it (:func:`.algorithms.eager_attention`); a float32 one of one query a run
        (a decode step's), in the runs that lower float32 matmuls as XLA's CPU backend does
        (``SEQUENTIAL_SUMS``), with its scores summed in order
        (:func:`.algorithms.in_order_scores_attention`)."""
        rows, device = (args[0].shape[0] if args[0].dim() > 2 else 0), args[0].device  # the query's
        apart = self.mode != "random" and rows and rows % self.samples == 0  # one run's rows apart from another's
        float32 = apart and all(a.dtype == torch.float32 for a in args[:3])
        exact = self._wider_results(func, args, kwargs) if float32 else None  # once, for both ways
        result = self._perturbed(func, args, kwargs, exact)
        if apart and args[0].dtype in EAGER_ATTENTION:
            return self._eager_rows(func, args, kwargs, result, rows)
        if exact is None:
            return result
        keep = self._pick(with_tensor_core_rows, device).repeat_interleave(rows // self.samples)
        result = with_tensor_core_rows(func, args, kwargs, result, exact[0], keep, self._generator(device))
        if args[0].shape[-2] != 1:  # not one query a run
            return result
        in_order = self._pick(self._matmul, device).repeat_interleave(rows // self.samples)
        if not in_order.any():
            return result
        taken = in_order.nonzero().squeeze(1)
        found = in_order_scores_attention(func, args, kwargs, taken, self._generator(device))
        return result if found is None else with_rows(result, taken, found)

    def _eager_rows(self, func: Any, args: tuple, kwargs: dict, result: Any, rows: int) -> Any:
        """``result`` of the fused attention op with the rows of the runs that take it computed
        as eager attention computes them, unperturbed: each of its ops rounds to nearest, as
        every eager port's does (its sums in float32 err far less than that rounding; rows
        that overflow so keep the fused result)."""
        keep = self._pick(eager_attention, args[0].device).repeat_interleave(rows // self.samples)
        if not keep.any():
            return result
        taken = keep.nonzero().squeeze(1)
        eager = eager_attention(func, args, kwargs, taken)
        return result if eager is None else with_rows(result, taken, eager)

    def _one_pass_variance(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``var`` or ``var_mean`` (any overload) computed by :func:`one_pass_var_mean`, its
        ops perturbed."""
        named = _named_arguments(func, args, kwargs)
        correction = named.get("correction")
        if "unbiased" in named:
            correction = 1 if named["unbiased"] in (None, True) else 0
        with self:
            var, mean = one_pass_var_mean(
                named["self"], named.get("dim"), correction=correction, keepdim=bool(named.get("keepdim"))
            )
        return (var, mean) if func.overloadpacket is torch.ops.aten.var_mean else var
