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
  (:func:`.sums.sequential_sum_error_std`); not without ``sixteen_bit_sums`` (Neuron's PSUM,
  cuBLAS, eager CPU sum in float32), nor in bfloat16 (no kernel sums in 8 significant bits);
* in half the runs (drawn apart), float32 matmuls are lowered as XLA's CPU backend lowers
  them (``lowerings.SEQUENTIAL_SUMS``): a one-row one (a decode step's token) sums its products in
  order, from its bias where it has one, computed as that backend computes it, one fused
  multiply-add at a time (:func:`.sums.fused_sequential_sum`); any other errs
  ``BLOCKED_SUM_SCALE`` times the reference kernel's (its sums in other blocks).

With ``break_ties``, a run also breaks exact ties among ``topk``'s candidates in an order of
its own, drawn per call: which of equal scores a router or a sparse-attention indexer takes
(DeepSeek-V3.2's indexer scores many keys exactly 0) is the implementation's. The layer tests
judge such choices one router at a time; the whole model's envelope runs with it.

Each run under a new seed is one legitimate implementation of the same layer: the spread of
a statistic over runs is what a correct port's statistic is judged against.

The alternatives a run draws for every op of a kind (a backend lowers all such ops one way)
are :mod:`.lowerings`'; the rounding of each result is this module's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .algorithms import (
    DECOMPOSED_OPS,
    VARIANCE_OPS,
    topk_ties_broken,
)
from .functions import approximated, keyed_draws
from .lowerings import DrawnLowerings
from .rounding import _UNIT_ROUNDOFF, _may_round, _rounds, another_rounding
from .sums import ACCUMULATING_OPS, accumulation_error, fused_sequential_sum
from .wider import (
    FUSED_ATTENTION_OPS,
    WIDENED_ATTENTION_OPS,
    _widen,
    attention_reference,
    exact_fast_matmul,
    widened_matmul,
)

MODES = ("jitter", "stochastic", "random")
#: How much less accurate than the reference's kernels a legitimate run's approximated
#: functions are in float32: twice the reference kernel's error (vendor math libraries
#: document 1 to 2 ulp for exp, erf, rsqrt).
ERROR_SCALE = 2.0
#: Result dtypes whose matmuls a legitimate kernel may accumulate in the result's own dtype.
SIXTEEN_BIT_ACCUMULATION = frozenset({torch.float16})
#: How much larger than the reference kernel's is the error of a float32 matmul of several rows
#: in that other lowering (its sums in other blocks): XLA's CPU backend errs 1.22 to 1.36 times
#: eager on prompt-shaped products (32 rows, k 640 to 2048, random operands; 1.1 at 4 rows).
BLOCKED_SUM_SCALE = 1.5
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


class PerturbedArithmetic(DrawnLowerings, TorchDispatchMode):
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

    @staticmethod
    def _in_order(
        name: str, args: tuple, kwargs: dict, value: torch.Tensor, wide: torch.Tensor, generator: torch.Generator
    ) -> torch.Tensor:
        """A float32 matmul's result summed in order from its bias, as the other lowering
        computes it (:func:`.sums.fused_sequential_sum`); one scaled by ``alpha`` or
        ``beta``, whose order is not known, gets a draw of that sum's error around ``wide``."""
        first, second = ACCUMULATING_OPS[name]
        if kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1:
            return fused_sequential_sum(args[first], args[second], args[0] if first == 1 else None).to(value.dtype)
        return (wide + accumulation_error(name, args, value.dtype, generator)).to(value.dtype)

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
        ``lowerings.SEQUENTIAL_SUMS``' other lowering does."""
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
                    results.append(self._in_order(name, args, kwargs, value, wide, generator))
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
