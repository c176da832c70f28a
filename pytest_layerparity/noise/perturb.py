"""Monte Carlo arithmetic for a PyTorch module, as Verificarlo, Verrou and CADNA estimate what
legitimate arithmetic does to a computation: each floating-point op's result rounded anew.

Under :class:`PerturbedArithmetic`, each op whose result is rounded (matmuls, sums,
elementwise arithmetic, transcendental functions, conversions to a narrower dtype) has its
floating outputs replaced, in one of three modes:

* ``"jitter"`` (the default): the op is computed again one precision wider; a float32
  result's error against that is kept or reflected at random per element (another reduction
  order: its size kept, not its sign), a 16-bit one's halved (``SIXTEEN_BIT_PULL``), and the
  point reached is moved within half an ulp and rounded to nearest (approximated functions,
  :func:`.functions.approximated`: up to 1.5 ulp off, the default scale doubling both parts
  for a float32 result) or rounded stochastically (the other results: one rounding).
* ``"stochastic"`` (Verificarlo's and Verrou's): every point, reflected or kept, rounded up
  or down at random, each neighbour in proportion to its closeness (a weaker null).
* ``"random"`` (CADNA's and Verrou's random rounding): the result as computed times
  ``1 + u * (e + s)``, ``u`` the output dtype's unit roundoff, ``e`` drawn per element from
  U(-1, 1) and ``s`` once per op from U(-systematic, systematic), rounded back.

Ops that move data without rounding (views, copies, indexing, concatenation, comparisons,
max/min, integer results) are left exact.

What a run models beyond rounding each op another way (all three answer the same question:
which results a correct port's kernels legitimately give):

* an approximated function's float32 (or float64) result errs ``ERROR_SCALE`` (2) times the
  reference kernel's (math libraries document 1 to 2 ulp); a pointwise op's on one 16-bit
  tensor is a function of that tensor's value in each run (:func:`.functions.keyed_draws`);
* fused norms and softmax (``DECOMPOSED_OPS``) run as their decompositions, so their mean,
  variance and sum are perturbed on their own and their error is shared by the whole row;
* a variance is computed half the time in one pass (E[x^2] - E[x]^2, ``one_pass_var_mean``),
  as fused norm kernels do, and otherwise as torch does (two passes);
* in half the runs, every 16-bit layer norm is computed in its own dtype (``OWN_DTYPE_NORMS``,
  :func:`layer_norm_in_own_dtype`), as XLA lowers it to a batch norm in the operand's type:
  float16 statistics kept as XLA rounds them (not perturbed: rows alike lean alike), a call's
  rows leaning by one scale drawn for it (``OWN_DTYPE_NORM_LEAN``); bfloat16's in float32;
  normalised values, scale and shift each rounded to the dtype; in half the runs (drawn
  apart), every 16-bit matmul with a bias rounds its product before adding the bias
  (``PRODUCT_ROUNDED_ADDMM``), as XLA's dot-then-add does (its double rounding's lean
  included); in half the runs (drawn apart), a fused float32 attention's results lean toward
  zero, as tensor cores return them (:mod:`.tensor_cores`), and a fused 16-bit attention is
  computed as transformers' eager attention computes it, its scores and probabilities rounded
  to nearest in the dtype (:func:`.algorithms.eager_attention`). A backend lowers all such
  ops one way: a run takes an alternative for all or none;
* a float16 matmul (``ACCUMULATING_OPS``) may keep its partial sums in float16
  (``SIXTEEN_BIT_ACCUMULATION``), as tensor cores' float16-accumulate mode and XLA's CPU
  backend do: its error drawn at the size of one sequential float16 sum of the same products
  (:func:`sequential_sum_error_std`); not without ``sixteen_bit_sums`` (Neuron's PSUM, cuBLAS,
  eager CPU sum in float32), nor in bfloat16 (no kernel sums in 8 significant bits);
* in half the runs (drawn apart), float32 matmuls are lowered as XLA's CPU backend lowers
  them (``SEQUENTIAL_SUMS``): a one-row one (a decode step's token) sums its products in
  order, from its bias where it has one, its error drawn at the size of that sum
  (:func:`sequential_sum_error_std`); any other errs ``BLOCKED_SUM_SCALE`` times the
  reference kernel's (its sums in other blocks).

With ``break_ties``, a run also breaks exact ties among ``topk``'s candidates in an order of
its own, drawn per call: which of equal scores a router or a sparse-attention indexer takes
(DeepSeek-V3.2's indexer scores many keys exactly 0) is the implementation's. The layer tests
judge such choices one router at a time; the whole model's envelope runs with it.

Each run under a new seed is one legitimate implementation of the same layer: the spread of
a statistic over runs is what a correct port's statistic is judged against.

Long because :class:`PerturbedArithmetic` is one dispatch mode whose alternatives for every
kind of op are drawn against the same per-run picks (a backend lowers all such ops one way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .algorithms import (
    DECOMPOSED_OPS,
    EAGER_ATTENTION,
    OWN_DTYPE_NORM_LEAN,
    OWN_DTYPE_NORMS,
    PRODUCT_ROUNDED_ADDMM,
    VARIANCE_OPS,
    WIDE_STATISTICS_NORMS,
    addmm_product,
    eager_attention,
    layer_norm_in_own_dtype,
    one_pass_var_mean,
    topk_ties_broken,
)
from .functions import approximated, keyed_draws
from .rounding import _UNIT_ROUNDOFF, ACCUMULATING_OPS, _may_round, _rounds, accumulation_error, another_rounding
from .tensor_cores import with_tensor_core_rows
from .wider import (
    FUSED_ATTENTION_OPS,
    WIDENED_ATTENTION_OPS,
    _named_arguments,
    _widen,
    attention_reference,
    exact_fast_matmul,
    widened_matmul,
    with_rows,
)

MODES = ("jitter", "stochastic", "random")
#: How much less accurate than the reference's kernels a legitimate run's approximated
#: functions are in float32: twice the reference kernel's error (vendor math libraries
#: document 1 to 2 ulp for exp, erf, rsqrt).
ERROR_SCALE = 2.0
#: Result dtypes whose matmuls a legitimate kernel may accumulate in the result's own dtype.
SIXTEEN_BIT_ACCUMULATION = frozenset({torch.float16})
#: Result dtypes whose one-row matmuls (a decode step's token times a weight) a run may sum one
#: product at a time, from the bias where there is one, in the runs that take it (half, drawn
#: apart): XLA's CPU backend fuses a one-row dot with its bias into one loop that does so
#: (measured at K 64 to 4096: its error is that of such a sum, 3.3 times eager's at K 896), as
#: torch's own CPU addmm does for one row times a (k, n) row-major weight. Products of more
#: rows go to blocked kernels (XLA's 4 and 32 rows err 1.1 and 1.25 times eager): taken for
#: all of them, the in-order sum widened Qwen2.5-Coder-0.5B's float32 prompt limits 6-fold. A
#: 16-bit matmul's sum in float32 is below its result's rounding (not modelled).
SEQUENTIAL_SUMS = frozenset({torch.float32})
#: How much larger than the reference kernel's is the error of a float32 matmul of several rows
#: in that other lowering (its sums in other blocks): XLA's CPU backend errs 1.22 to 1.36 times
#: eager on prompt-shaped products (32 rows, k 640 to 2048, random operands; 1.1 at 4 rows).
BLOCKED_SUM_SCALE = 1.5
#: The one-row matmuls of ``SEQUENTIAL_SUMS``, by packet name: the position of the rows' operand.
ONE_ROW_MATMULS = {"mm": 0, "addmm": 1}
#: A 16-bit result any kernel computes in float32 and rounds to nearest (not an approximated
#: function's) is rounded stochastically from this fraction of the way from its exact value to
#: the reference's result: 1.5 times a correct rounding's squared error, where a correct port's
#: is one and stochastic rounding's two (its spread between runs 1.25 times that of
#: independent correct roundings).
SIXTEEN_BIT_PULL = 0.5


def _rounded_wide_result(func: Any, args: tuple, kwargs: dict, exact: list[Any] | None) -> torch.Tensor | None:
    """A 16-bit op's result as its float32 result (``exact``, computed for the perturbation)
    rounded once, where every floating operand is of one 16-bit dtype, the op returns one
    tensor, changes none of its inputs and takes no dtype of its own; else None (the op is run
    as it is). Kernels compute a 16-bit result in float32 and round it once (a matmul's sum
    in another order may round the other way in a rare element), so this is one legitimate
    kernel's result, and the 16-bit op itself (a matmul: a quarter of the float32 one's time
    on the CPU) is not run again beside it. A float32 result keeps its own kernel's result:
    its error against the float64 one (a library's exp, a long sum) is what the perturbation
    reflects."""
    if exact is None or len(exact) != 1 or not isinstance(exact[0], torch.Tensor) or func._schema.is_mutable:
        return None
    if any(isinstance(v, torch.dtype) for v in (*args, *kwargs.values())):
        return None
    dtypes = {a.dtype for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()}
    if len(dtypes) != 1 or len(func._schema.returns) != 1:
        return None
    (dtype,) = dtypes
    if dtype not in (torch.bfloat16, torch.float16) or exact[0].dtype != torch.float32:
        return None
    return exact[0].to(dtype)


class PerturbedArithmetic(TorchDispatchMode):
    """While active, rounded floating-point results are rounded another legitimate way (see
    the module's docstring for the ``mode``s). ``systematic`` scales the per-op bias of
    the random mode. ``error_scale`` multiplies the error of an approximated function's
    float32 or float64 result in the other modes (how much less accurate than the
    reference's kernels this run's are; default ERROR_SCALE; every other result keeps 1);
    ``sixteen_bit_sums``: float16 matmuls may sum in float16 (``SIXTEEN_BIT_ACCUMULATION``).
    ``ops`` counts the results perturbed."""

    def __init__(
        self,
        seed: int,
        mode: str = "jitter",
        systematic: float = 0.0,
        error_scale: float | None = None,
        samples: int = 1,
        break_ties: bool = False,
        sixteen_bit_sums: bool = True,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"unknown perturbation mode {mode!r}; choose one of {', '.join(MODES)}")
        self.seed = seed
        self.samples = samples  # runs stacked along the first dim, each its own legitimate run
        self.mode = mode
        self.systematic = systematic
        self.error_scale = ERROR_SCALE if error_scale is None else error_scale
        self.break_ties = break_ties
        self.sixteen_bit_sums = sixteen_bit_sums
        self.ops = 0
        self._generators: dict[torch.device, torch.Generator] = {}
        self._tie_generators: dict[torch.device, torch.Generator] = {}  # the arithmetic's draws stay as they were
        self._picks: dict[Any, torch.Tensor] = {}  # per alternative (its code) and device: which runs take it

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def _random(self, tensor: torch.Tensor) -> torch.Tensor:
        u = _UNIT_ROUNDOFF.get(tensor.dtype)
        if u is None or tensor.numel() == 0:
            return tensor
        self.ops += 1
        work = torch.float64 if tensor.device.type == "cpu" or tensor.dtype == torch.float32 else torch.float32
        generator = self._generator(tensor.device)
        noise = torch.rand(tensor.shape, generator=generator, dtype=work, device=tensor.device) * 2 - 1
        bias = (torch.rand((), generator=generator, dtype=work, device=tensor.device) * 2 - 1) * self.systematic
        return (tensor.detach().to(work) * (1 + u * (noise + bias))).to(tensor.dtype)

    def _scale(self, name: str, dtype: torch.dtype) -> float:
        """The error scale of op ``name``'s result in ``dtype``: ``error_scale`` for an
        approximated function's float32 or float64 result (:func:`.functions.approximated`);
        else 1 (a 16-bit result is computed in float32 and rounded once whatever the kernel)."""
        wide = _UNIT_ROUNDOFF.get(dtype, 1.0) <= _UNIT_ROUNDOFF[torch.float32]
        return self.error_scale if wide and approximated(name) else 1.0

    def _topk_ties_broken(self, func: Any, args: tuple, kwargs: dict) -> Any:
        device = args[0].device
        generator = self._tie_generators.setdefault(device, torch.Generator(device=device).manual_seed(self.seed))
        return topk_ties_broken(func, args, kwargs, generator)

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
        one-row product (a decode step's token times a weight) with its error drawn as that of
        its products summed in order from its bias (:func:`.rounding.accumulation_error`), any
        other with its error ``BLOCKED_SUM_SCALE`` times the reference kernel's."""

        def standard(exact: list[Any] | None = None) -> Any:
            if exact is None and func is torch.ops.aten.addmm.default:  # (a 16-bit one's alternative)
                return self._addmm(func, args, kwargs)
            return self._perturbed(func, args, kwargs, exact)

        floating = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        if self.mode == "random" or not floating or any(a.dtype not in SEQUENTIAL_SUMS for a in floating):
            return standard()
        rows = ONE_ROW_MATMULS.get(func.overloadpacket.__name__)
        one_row = rows is not None and args[rows].dim() == 2 and args[rows].shape[0] == self.samples  # a run's
        exact = self._wider_results(func, args, kwargs)  # once, for both ways
        return self._drawn(
            args,
            SEQUENTIAL_SUMS,
            lambda: self._perturbed(func, args, kwargs, exact, in_order=one_row, blocked=not one_row),
            lambda: standard(exact),
        )

    def _drawn(self, args: tuple, dtypes: frozenset, other: Callable[[], Any], standard: Callable[[], Any]) -> Any:
        """``other()`` or ``standard()`` where every floating operand in ``args`` is of
        ``dtypes`` (else ``standard()``), chosen once per run for each alternative (``other``'s
        code): an implementation lowers every such op one way, so a run takes it for all of
        them or for none, half the runs each. The rows of the first operand with rows are the
        stacked runs'."""
        floating = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        x = next((a for a in floating if a.dim() > 1), floating[0] if floating else None)
        if self.mode == "random" or x is None or x.dim() == 0 or any(a.dtype not in dtypes for a in floating):
            return standard()
        return self._either(x, other, standard, self._pick(other, x.device))

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
        computes it (:func:`.algorithms.eager_attention`)."""
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
        return with_tensor_core_rows(func, args, kwargs, result, exact[0], keep, self._generator(device))

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

    def _wider_results(self, func: Any, args: tuple, kwargs: dict) -> list[Any] | None:
        """The op's results computed from its inputs widened one step, or None when it
        cannot be (an op that insists on its dtypes)."""
        name = func.overloadpacket.__name__
        if name in FUSED_ATTENTION_OPS and name not in WIDENED_ATTENTION_OPS:
            return [attention_reference(func, args, kwargs)]
        try:
            with exact_fast_matmul(func, args, kwargs):
                exact = widened_matmul(func, args, kwargs, _widen)
                if exact is None:
                    exact = func(*tree_map(_widen, args), **tree_map(_widen, kwargs))
        except (RuntimeError, TypeError, NotImplementedError):
            return None
        return tree_flatten(exact)[0]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.break_ties and func is torch.ops.aten.topk.default:
            return self._topk_ties_broken(func, args, kwargs)
        if func is torch.ops.aten.native_layer_norm.default and func in DECOMPOSED_OPS:
            return self._layer_norm(func, args, kwargs)
        if func.overloadpacket.__name__ in ACCUMULATING_OPS and not func._schema.is_mutable:
            return self._matmul(func, args, kwargs)
        decomposition = DECOMPOSED_OPS.get(func)
        if decomposition is not None:
            with self:  # each op of the decomposition dispatches here again
                return decomposition(*args, **kwargs)
        if func.overloadpacket in VARIANCE_OPS:
            return self._variance(func, args, kwargs)
        if func.overloadpacket.__name__ in FUSED_ATTENTION_OPS:
            return self._attention(func, args, kwargs)
        return self._perturbed(func, args, kwargs)

    def _perturbed(
        self,
        func: Any,
        args: tuple,
        kwargs: dict,
        exact: list[Any] | None = None,
        in_order: bool = False,
        blocked: bool = False,
    ) -> Any:
        """``func`` run, its rounded floating results rounded another legitimate way (around
        ``exact``, given); a float32 matmul's products summed in order from its bias
        (``in_order``) or in other blocks (``blocked``: ``BLOCKED_SUM_SCALE``), as
        ``SEQUENTIAL_SUMS``' other lowering does."""
        name = func.overloadpacket.__name__
        if exact is None and self.mode != "random" and name != "_to_copy" and _may_round(func):
            exact = self._wider_results(func, args, kwargs)  # before an in-place op changes its input
        source = args[0] if name == "_to_copy" and args else None
        out = _rounded_wide_result(func, args, kwargs, exact)
        if out is None:
            out = func(*args, **kwargs)
        if not _rounds(func, args, out):
            return out
        if source is not None:
            exact = [source]
        inputs = {id(a) for a in args if isinstance(a, torch.Tensor)}
        flat, spec = tree_flatten(out)
        results = []
        for i, value in enumerate(flat):
            if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() == 0:
                results.append(value)
                continue
            if self.mode == "random":
                perturbed = self._random(value)
            else:
                wide = exact[i] if exact is not None and i < len(exact) else None
                if (
                    not isinstance(wide, torch.Tensor)
                    or wide.shape != value.shape
                    or _UNIT_ROUNDOFF.get(wide.dtype, 1) >= _UNIT_ROUNDOFF.get(value.dtype, 0)
                ):
                    results.append(value)
                    continue
                self.ops += 1
                generator = self._generator(value.device)
                if in_order:  # (a float32 matmul: _matmul's)
                    # the sum's own error (each partial sum rounded, the last one included) around the exact result
                    from_bias = kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1
                    error = accumulation_error(name, args, value.dtype, generator, from_bias)
                    results.append((wide + error).to(value.dtype))
                    continue
                summed = self.sixteen_bit_sums and name in ACCUMULATING_OPS and value.dtype in SIXTEEN_BIT_ACCUMULATION
                if summed:
                    wide = wide + accumulation_error(name, args, value.dtype, generator)
                jitter, scale = self.mode == "jitter" and approximated(name), self._scale(name, value.dtype)
                if blocked:  # (a float32 matmul: _matmul's)
                    scale *= BLOCKED_SUM_SCALE
                sixteen = value.dtype in (torch.bfloat16, torch.float16)
                pull = SIXTEEN_BIT_PULL if self.mode == "jitter" and sixteen and not (jitter or summed) else None
                draws = keyed_draws(func, args, value, self.seed, self.samples)
                perturbed = another_rounding(value, wide, generator, jitter, scale, draws, pull)
            if id(value) in inputs:  # an in-place op: perturb the tensor itself
                value.copy_(perturbed)
                results.append(value)
            else:
                results.append(perturbed)
        return tree_unflatten(results, spec)
