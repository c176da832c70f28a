"""Directions of a layer's output that ``branch_bias`` is measured along beside the
branches', each the output's move under one small change of the layer's arithmetic, made in
the precision floor's pass (:mod:`.wide_pass`): the attention's temperature
(:func:`temperature_direction`), the norms' epsilon (:func:`norm_epsilon_direction`) and
GELU's other form (:func:`gelu_form_direction`). A port that gets one of them wrong moves its
output along that direction, and along no branch's output."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..compare.parts import NORM_WEIGHT_PREFIX
from .tokens import is_norm

#: The attention's temperature (``floor.branch.attention_temperature``): what the layer's
#: output does when every attention score is scaled by ``1 - TEMPERATURE_STEP`` before its
#: softmax. A port's attention scaled wrong (another softmax scale, a temperature,
#: soft-capping dropped) moves the output along it: it changes how the values are mixed, not
#: how much of the attention is added.
TEMPERATURE_BRANCH = "attention_temperature"
TEMPERATURE_STEP = 1e-3
#: The norms' epsilon (``floor.branch.norm_epsilon``): what the layer's output does when the
#: epsilon of every norm in it is raised by ``NORM_EPSILON_STEP`` times the median over tokens
#: of the variance of the layer's input (one step for all its norms, as a port that reads
#: another ``rms_norm_eps`` has: large enough to show in the floor's precision, small enough
#: to stay linear). Such a port scales each token's normalised states by a factor that
#: depends on the token's own variance: not a scale of any branch.
NORM_EPSILON_BRANCH = "norm_epsilon"
NORM_EPSILON_STEP = 1e-3
#: The attributes a norm keeps its epsilon in (Llama's and most RMSNorms', torch's norms',
#: a few others').
EPSILON_ATTRIBUTES = ("variance_epsilon", "eps", "epsilon")
#: GELU's form (``floor.branch.gelu_form``): what the layer's output does when each GELU in it
#: computes its other common form, the tanh approximation where it computes erf's and erf's
#: where it computes the approximation (a port that reads ``hidden_act`` as the other one).
#: Its modules by class: torch's ``GELU`` and transformers' activations.
GELU_FORM_BRANCH = "gelu_form"
ERF_GELUS = frozenset({"GELUActivation"})
TANH_GELUS = frozenset({"NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation"})
#: The softmax functions whose 4-D input :class:`SofterAttention` scales.
SOFTMAX_FUNCTIONS = frozenset({torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax, torch.special.softmax})


class SofterAttention(TorchFunctionMode):
    """While active, every attention's scores are scaled by ``factor`` before their softmax:
    the ``scale`` of ``scaled_dot_product_attention``, and the input of a softmax over a 4-D
    tensor (batch, heads, queries, keys; a router's softmax is over tokens and experts).
    ``hits`` counts them."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor, self.hits = factor, 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.nn.functional.scaled_dot_product_attention:  # its scale is keyword-only
            scale = kwargs.get("scale")
            kwargs["scale"] = (scale if scale is not None else args[0].shape[-1] ** -0.5) * self.factor
            self.hits += 1
        elif func in SOFTMAX_FUNCTIONS and args and getattr(args[0], "dim", lambda: 0)() == 4:
            args = (args[0] * self.factor, *args[1:])
            self.hits += 1
        return func(*args, **kwargs)


def _norms(layer: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every norm in ``layer`` (a module below it named ``*norm`` or of a class ``*Norm``), by
    name."""
    return [(n, m) for n, m in layer.named_modules() if n and is_norm(n.rsplit(".", 1)[-1], m)]


def norm_epsilons(layer: torch.nn.Module) -> list[tuple[torch.nn.Module, str, float]]:
    """Every norm in ``layer`` (a module named ``*norm`` or of a class ``*Norm``) that keeps its
    epsilon as a number in one of ``EPSILON_ATTRIBUTES``: (the norm, the attribute, the value)."""
    found = []
    for _, module in _norms(layer):
        for attribute in EPSILON_ATTRIBUTES:
            value = getattr(module, attribute, None)
            if isinstance(value, float) and not isinstance(value, bool):
                found.append((module, attribute, value))
                break
    return found


@contextmanager
def changed_norm_epsilon(layer: torch.nn.Module, change: Callable[[float], float]) -> Iterator[int]:
    """While active, the epsilon of every norm in ``layer`` (:func:`norm_epsilons`) is
    ``change`` of its own; yields how many norms that is, and puts each epsilon back."""
    norms = norm_epsilons(layer)
    for module, attribute, value in norms:
        setattr(module, attribute, change(value))
    try:
        yield len(norms)
    finally:
        for module, attribute, value in norms:
            setattr(module, attribute, value)


def raised_norm_epsilon(layer: torch.nn.Module, step: float) -> contextlib.AbstractContextManager[int]:
    """:func:`changed_norm_epsilon`, every epsilon ``step`` higher."""
    return changed_norm_epsilon(layer, lambda value: value + step)


def _move(moved: torch.Tensor, out: torch.Tensor, max_output_cosine: float) -> tuple[torch.Tensor, float] | None:
    """``moved - out`` scaled to ``out``'s norm (a direction), and the move's norm over that
    (its size, where the move is a bug's whole effect); None where the move is nil, not
    finite, or along the output itself (a cosine over ``max_output_cosine``, the branches' own
    bound: a scale of the whole output)."""
    d = moved.detach().sub_(out)  # in the pass's own dtype: one more output-sized tensor
    size, out_size = float(d.norm()), float(out.norm())
    along = float((d.flatten() @ out.detach().flatten().to(d.dtype)).abs())
    if not (0 < size < float("inf")) or out_size == 0 or along > max_output_cosine * size * out_size:
        return None
    return d.mul_(out_size / size), size / out_size


#: A direction (scaled to the output's norm) and the output's move per unit of its change's
#: own measure, as a multiple of the direction.
Stepped = tuple[torch.Tensor, float]


def _per_unit(moved: torch.Tensor, out: torch.Tensor, max_output_cosine: float, step: float) -> Stepped | None:
    """:func:`_move` of a change ``step`` long in its own measure: the direction and the move
    per unit of that measure, as a multiple of the direction (``compare.sight`` states how
    large a change of the kind a test sees from it)."""
    found = _move(moved, out, max_output_cosine)
    return None if found is None else (found[0], found[1] / step)


def temperature_direction(
    run: Callable[[], torch.Tensor], out: torch.Tensor, max_output_cosine: float
) -> Stepped | None:
    """How the layer's output ``out`` moves under a softer attention: ``run()`` (the same call
    made anew, in the same arithmetic) under :class:`SofterAttention`, as :func:`_per_unit`
    (per unit of the scores' relative scale, lowered); None where no attention ran (no softmax
    of scores)."""
    softer = SofterAttention(1 - TEMPERATURE_STEP)
    with softer:
        moved = run()
    return _per_unit(moved, out, max_output_cosine, TEMPERATURE_STEP) if softer.hits else None


def norm_epsilon_direction(
    layer: torch.nn.Module,
    hidden_in: torch.Tensor | None,
    run: Callable[[], torch.Tensor],
    out: torch.Tensor,
    max_output_cosine: float,
) -> Stepped | None:
    """How the layer's output ``out`` moves with its norms' epsilon raised
    (:data:`NORM_EPSILON_STEP`, :func:`raised_norm_epsilon`): ``run()`` so, as
    :func:`_per_unit` (per unit of the epsilon itself). None without the layer's input
    ``hidden_in``, or where the layer has no norm whose epsilon it keeps."""
    if hidden_in is None or hidden_in.dim() < 1 or hidden_in.shape[-1] < 2:
        return None
    spread = float(hidden_in.detach().reshape(-1, hidden_in.shape[-1]).var(-1, unbiased=False).median())
    if not 0 < spread < float("inf"):
        return None
    with raised_norm_epsilon(layer, NORM_EPSILON_STEP * spread) as norms:
        if not norms:
            return None
        moved = run()
    return _per_unit(moved, out, max_output_cosine, NORM_EPSILON_STEP * spread)


#: The attention's output scaled (``floor.sight.attention_scale``): what the layer's output
#: does when its attention branch's output is scaled by ``1 + BRANCH_SCALE_STEP``: the
#: branch's own output and what the rest of the layer makes of it (the MLP after it answers;
#: a post-norm undoes it). ``compare.sight`` states a test's limit for the kind along it.
ATTENTION_SCALE = "attention_scale"
BRANCH_SCALE_STEP = 1e-3
#: The norms' epsilon as a factor (``floor.sight.norm_epsilon``): what the layer's output does
#: when every norm's epsilon is ``1 + EPSILON_FACTOR_STEP`` times its own (x10: a port that
#: reads 1e-5 for 1e-6), a change small beside the variance of any norm's input, so the move
#: is linear in it (``NORM_EPSILON_STEP``, the verdict's direction, is set by the layer's
#: input and is not, for a q/k norm or a post-norm).
NORM_EPSILON_FACTOR = "norm_epsilon"
EPSILON_FACTOR_STEP = 9.0


def output_scaler(factor: float) -> Callable[[Any, Any, Any], Any]:
    """A forward hook that makes a module's output (its first tensor) ``factor`` times what it
    computes."""

    def hook(_module: Any, _args: Any, output: Any) -> Any:
        if isinstance(output, (tuple, list)) and output:
            return type(output)((output[0] * factor, *output[1:]))
        return output * factor

    return hook


@contextmanager
def scaled_output(module: torch.nn.Module, factor: float) -> Iterator[None]:
    """While active, ``module``'s output (its first tensor) is ``factor`` times what it computes."""
    handle = module.register_forward_hook(output_scaler(factor))
    try:
        yield
    finally:
        handle.remove()


def branch_scale_direction(
    module: torch.nn.Module, run: Callable[[], torch.Tensor], out: torch.Tensor, max_output_cosine: float
) -> Stepped | None:
    """How the layer's output ``out`` moves with the branch ``module``'s output scaled
    (:data:`BRANCH_SCALE_STEP`): ``run()`` so, as :func:`_per_unit` (per unit of scale)."""
    with scaled_output(module, 1 + BRANCH_SCALE_STEP):
        moved = run()
    return _per_unit(moved, out, max_output_cosine, BRANCH_SCALE_STEP)


def epsilon_factor_direction(
    layer: torch.nn.Module, run: Callable[[], torch.Tensor], out: torch.Tensor, max_output_cosine: float
) -> Stepped | None:
    """How the layer's output ``out`` moves with every norm's epsilon (:func:`norm_epsilons`)
    ``1 + EPSILON_FACTOR_STEP`` times its own: ``run()`` so, as :func:`_per_unit` (per unit of
    the factor less one); None where the layer has no such norm."""
    with changed_norm_epsilon(layer, lambda value: value * (1 + EPSILON_FACTOR_STEP)) as norms:
        if not norms:
            return None
        moved = run()
    return _per_unit(moved, out, max_output_cosine, EPSILON_FACTOR_STEP)


def _gelu_form(module: torch.nn.Module) -> str | None:
    """The ``approximate`` of the GELU form ``module`` computes ("none": erf's, "tanh"), or
    None where it is no GELU of a known form."""
    if isinstance(module, torch.nn.GELU):
        return module.approximate
    name = type(module).__name__
    return "none" if name in ERF_GELUS else "tanh" if name in TANH_GELUS else None


@contextmanager
def other_gelu_form(layer: torch.nn.Module) -> Iterator[int]:
    """While active, each GELU module in ``layer`` (:func:`_gelu_form`) computes the other
    form; yields how many there are, and gives each its own forward back."""
    swapped: list[tuple[torch.nn.Module, Any]] = []
    for module in layer.modules():
        form = _gelu_form(module)
        if form is None:
            continue
        other = "tanh" if form == "none" else "none"
        swapped.append((module, module.__dict__.get("forward")))  # an instance's own forward (a hook's) kept
        module.forward = lambda x, other=other: torch.nn.functional.gelu(x, approximate=other)
    try:
        yield len(swapped)
    finally:
        for module, own in swapped:
            if own is None:
                del module.forward
            else:
                module.forward = own


def gelu_form_direction(
    layer: torch.nn.Module, run: Callable[[], torch.Tensor], out: torch.Tensor, max_output_cosine: float
) -> tuple[torch.Tensor, float] | None:
    """How the layer's output ``out`` moves with each GELU in the other form
    (:func:`other_gelu_form`): ``run()`` so, as :func:`_move` (the direction and the swap's
    size over its norm); None where the layer has no GELU module of a known form."""
    with other_gelu_form(layer) as gelus:
        if not gelus:
            return None
        moved = run()
    return _move(moved, out, max_output_cosine)


#: The norms' biases (``floor.cause.norm_bias``): what the layer's output does when every
#: norm's bias is ``1 - BRANCH_SCALE_STEP`` times its own (a converter that loads a LayerNorm's
#: weight and leaves its bias at zero moves the output along it, far from any branch's).
NORM_BIAS_CAUSE = "norm_bias"


def _scaled_moves(
    modules: list[tuple[str, torch.nn.Module]],
    run: Callable[[], torch.Tensor],
    out: torch.Tensor,
    max_output_cosine: float,
) -> dict[str, torch.Tensor]:
    """:func:`_move` of the layer's output ``out`` with each of ``modules``' output scaled by
    ``1 + BRANCH_SCALE_STEP`` in turn, by the name given (none where the move is nil or along
    the output itself)."""
    found = {}
    for name, module in modules:
        with scaled_output(module, 1 + BRANCH_SCALE_STEP):
            moved = _move(run(), out, max_output_cosine)
        if moved is not None:
            found[name] = moved[0]
    return found


def norm_weight_directions(
    layer: torch.nn.Module, run: Callable[[], torch.Tensor], out: torch.Tensor, max_output_cosine: float
) -> dict[str, torch.Tensor]:
    """Each norm's weight (``floor.cause.norm_weight.<norm>``): :func:`_scaled_moves` of each
    norm, by ``NORM_WEIGHT_PREFIX`` and the norm's name (none for a last norm: its move is the
    output's own scale). A weight read otherwise (the ``(1 + w)`` convention twice, a weight
    left at one) scales the norm's output; before a branch that scales the branch's input, not
    its output: the MLP answers a wrong post-attention norm otherwise than a wrong MLP. The
    diagnosis alone reads them (``compare.diagnosis``)."""
    return _scaled_moves([(NORM_WEIGHT_PREFIX + n, m) for n, m in _norms(layer)], run, out, max_output_cosine)


def norm_bias_direction(
    layer: torch.nn.Module, run: Callable[[], torch.Tensor], out: torch.Tensor, max_output_cosine: float
) -> torch.Tensor | None:
    """:func:`_move` of the layer's output ``out`` with every norm's bias lowered by
    ``BRANCH_SCALE_STEP`` of itself (taken off each norm's output, in the pass's own
    arithmetic: a 16-bit weight would round the step away); None where no norm has a bias."""
    norms = [module for _, module in _norms(layer) if isinstance(getattr(module, "bias", None), torch.Tensor)]
    if not norms:
        return None

    def lowered(module: torch.nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        return output - BRANCH_SCALE_STEP * module.bias.to(output.dtype)

    handles = [module.register_forward_hook(lowered) for module in norms]
    try:
        moved = _move(run(), out, max_output_cosine)
    finally:
        for handle in handles:
            handle.remove()
    return None if moved is None else moved[0]


#: An attention inside a branch (``floor.cause.inner_attention.<module>``): what the layer's
#: output does when the output of an attention module nested in one of its children is
#: scaled by ``1 + BRANCH_SCALE_STEP``, as in a post-norm encoder, whose attention branch ends
#: in its norm (its own move is that norm's weight). A head dropped or a projection read wrong
#: there moves the output partly along it.
INNER_ATTENTION_PREFIX = "inner_attention."


def inner_attention_directions(
    layer: torch.nn.Module, run: Callable[[], torch.Tensor], out: torch.Tensor, max_output_cosine: float
) -> dict[str, torch.Tensor]:
    """:func:`_scaled_moves` of each nested attention (a module below the layer's children
    whose class is an ``*Attention``), by ``INNER_ATTENTION_PREFIX`` and its name."""
    nested = [
        (INNER_ATTENTION_PREFIX + n, m)
        for n, m in layer.named_modules()
        if "." in n and type(m).__name__.endswith("Attention")
    ]
    return _scaled_moves(nested, run, out, max_output_cosine)


#: A move for the diagnosis alone is kept only where it differs from every stored direction:
#: its squared cosine with each below this (a q/k norm's weight moves the output as the
#: attention's temperature does: no error reads more along one than along the other).
DISTINCT_COSINE2 = 0.99


def distinct_moves(moves: dict[str, torch.Tensor], stored: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``moves`` whose squared cosine with each ``stored`` direction (of their shape) is
    below :data:`DISTINCT_COSINE2`."""

    def cosine2(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.detach().to("cpu", torch.float64).flatten(), b.detach().to("cpu", torch.float64).flatten()
        sizes = float(a.norm()) * float(b.norm())
        return (float(a @ b) / sizes) ** 2 if sizes > 0 else 0.0

    return {
        name: move
        for name, move in moves.items()
        if all(s.shape != move.shape or cosine2(move, s) < DISTINCT_COSINE2 for s in stored)
    }
