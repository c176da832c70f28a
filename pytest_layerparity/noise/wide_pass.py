"""The precision floor: a layer evaluated in higher precision (float32 for 16-bit goldens,
float64 for float32 ones; on the CPU). Extraction stores it with each golden; chained runs
evaluate it along the chain. The verdict measures the target's error against it in units of
the golden's own rounding error.

The layer's weights stay in the golden's dtype: every op is computed in the floor dtype on
its operands widened for that op alone (:class:`~.wider.WiderArithmetic`), which gives
what the layer with its weights converted computes (the conversion is exact) without a
second, wider copy of the layer in memory."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ..capture.router_hooks import capture_routing, floor_routing
from ..compare.floor import BRANCH_PREFIX, CAUSE_PREFIX, HEADS_KEY, MOVE_PREFIX, SIGHT_PREFIX, STEP_PREFIX
from ..compare.parts import direction_part
from ..model.build import eager_experts_skeleton
from ..model.checkpoint import load_layer
from ..model.memory import give_back_memory
from ..model.source import ModelSource
from ..store.callspec import cache_argument, decode_call, first_tensor, hidden_input_name, replace_hidden_input
from ..store.kv_updates import appended_kv

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


FLOOR_NEW_KEYS = "floor.cache.new_keys"
FLOOR_NEW_VALUES = "floor.cache.new_values"


@contextmanager
def capture_branches(layer: torch.nn.Module, out: dict[str, torch.Tensor]) -> Iterator[None]:
    """While active, the output of each child of ``layer`` that has parameters and is not a
    norm (its attention, its MLP or mixture of experts, a projection) is kept in ``out`` by the
    child's name (its first tensor, as computed); a child called more than once is left out
    (its output is not one branch's)."""
    from .tokens import is_norm

    calls: dict[str, int] = {}

    def keep(name: str) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            calls[name] = calls.get(name, 0) + 1
            first = output[0] if isinstance(output, (tuple, list)) and output else output
            if calls[name] == 1 and getattr(first, "is_floating_point", lambda: False)():
                out[name] = first.detach().clone()  # a layer may add its residual into it in place
            else:
                out.pop(name, None)

        return hook

    handles = [
        child.register_forward_hook(keep(name))
        for name, child in layer.named_children()
        if not is_norm(name, child) and any(True for _ in child.parameters(recurse=True))
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


#: A branch's output is one part of the layer's contribution, what ``branch_bias`` measures
#: along, when it lies along the contribution (output - input) at a cosine of at least this and
#: is not the output itself (a cosine with the output of at most ``MAX_BRANCH_OUTPUT_COSINE``).
#: A pre-norm decoder's attention and MLP read 0.37-0.92 along the contribution and 0.18-0.54
#: along the output (bench/README.md, "Verdicts"); a post-norm encoder's children return whole
#: normalised states (BERT's ``attention`` and ``output``: -0.15-0.19 along the contribution,
#: ``output`` 1.0 along the output), along which a legitimate normalisation kernel leans.
MIN_BRANCH_CONTRIBUTION_COSINE = 0.25
MAX_BRANCH_OUTPUT_COSINE = 0.95


def contribution_branches(
    branches: Mapping[str, torch.Tensor], out: torch.Tensor, hidden_in: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The ``branches`` that are parts of the layer's contribution (see
    ``MIN_BRANCH_CONTRIBUTION_COSINE``): none without the layer's input."""
    import torch

    if not branches or hidden_in is None or tuple(hidden_in.shape) != tuple(out.shape):
        return {}
    o = out.detach().to("cpu", torch.float64).flatten()
    u = o - hidden_in.detach().to("cpu", torch.float64).flatten()
    kept = {}
    for name, branch in branches.items():
        if tuple(branch.shape) != tuple(out.shape):
            continue
        v = branch.detach().to("cpu", torch.float64).flatten()
        size = float(v.norm())
        norms = size * float(u.norm()), size * float(o.norm())
        if min(norms) <= 0:
            continue
        along, same = float(v @ u) / norms[0], float(v @ o) / norms[1]
        if along >= MIN_BRANCH_CONTRIBUTION_COSINE and same <= MAX_BRANCH_OUTPUT_COSINE:
            kept[name] = branch
    return kept


def floor_dtype(golden_dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit goldens, float64 for float32 ones."""
    import torch

    return torch.float64 if golden_dtype == torch.float32 else torch.float32


class FloorEvaluator:
    """Evaluates the layers of one model in the floor dtype of ``golden_dtype``."""

    def __init__(self, model: ModelSource, golden_dtype: torch.dtype) -> None:
        self.model = model
        self.golden_dtype = golden_dtype
        self.dtype = floor_dtype(golden_dtype)

    @cached_property
    def skeleton(self) -> PreTrainedModel:
        return eager_experts_skeleton(self.model.hf_config, self.golden_dtype, self.model.trust_remote_code)

    def load(self, index: int) -> torch.nn.Module:
        """Layer ``index`` in the golden dtype on the CPU, with eager experts (what the floor
        evaluates; the noise envelope's runs use the same build)."""
        return load_layer(
            self.skeleton, self.model.checkpoint, self.model.layer_list[0], index, self.golden_dtype
        ).eval()

    def evaluate(
        self,
        index: int,
        spec: Mapping[str, Any],
        tensors: Mapping[str, torch.Tensor],
        hidden: torch.Tensor | None = None,
        layer: torch.nn.Module | None = None,
        extras: bool = True,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Layer ``index`` on the call ``spec``/``tensors`` (hidden states replaced by
        ``hidden`` when given, for chains), in the floor dtype. Returns the output and the
        routers' exact logits and scores (``floor.routing.*``), the output of each of the
        layer's branches in the golden's dtype (``floor.branch.*``, :func:`capture_branches`:
        the directions ``branch_bias`` is measured along) and the attention temperature's, the
        norms' epsilon's and GELU's other form's (``floor.branch.attention_temperature``,
        ``.norm_epsilon``, ``.gelu_form``: :mod:`.directions`), and for a decode step the keys and
        values the layer appended to its KV cache (``floor.cache.new_keys``/``new_values``).
        ``layer``: the layer already loaded (by :meth:`load`), else it is loaded and given back.
        Without ``extras``, the output alone (a chain's floor step: the routers, branches and
        appended keys and values are not captured)."""
        import torch

        from ..compare.sketch import unit_sketches
        from .directions import (
            ATTENTION_SCALE,
            GELU_FORM_BRANCH,
            NORM_BIAS_CAUSE,
            NORM_EPSILON_BRANCH,
            NORM_EPSILON_FACTOR,
            TEMPERATURE_BRANCH,
            branch_scale_direction,
            distinct_moves,
            epsilon_factor_direction,
            gelu_form_direction,
            inner_attention_directions,
            norm_bias_direction,
            norm_epsilon_direction,
            norm_weight_directions,
            temperature_direction,
        )
        from .heads import capture_heads, head_parts
        from .tokens import in_token_blocks
        from .wider import WiderArithmetic

        owned = layer is None
        if layer is None:
            layer = self.load(index)
        upcast = {k: (v.to(self.dtype) if torch.is_floating_point(v) else v) for k, v in tensors.items()}
        if hidden is not None:
            upcast = replace_hidden_input(spec, upcast, hidden)

        def forward(*captures: Any, call: Mapping[str, torch.Tensor] = upcast) -> tuple[torch.Tensor, list, dict]:
            """The layer on the call (its KV cache made anew) in the floor dtype, with
            ``captures`` active: the output and the call's arguments."""
            args, kwargs = decode_call(spec, call, cache_name=cache_argument(layer))
            with ExitStack() as stack:
                stack.enter_context(torch.no_grad())
                for capture in captures:
                    stack.enter_context(capture)
                stack.enter_context(in_token_blocks(layer))
                stack.enter_context(WiderArithmetic(self.dtype))
                return first_tensor(layer(*args, **kwargs)), args, kwargs

        routing: dict[str, torch.Tensor] = {}
        branches: dict[str, torch.Tensor] = {}
        heads: dict[str, Any] = {}
        attention_child = next((c for n, c in layer.named_children() if direction_part(n) == "attention"), None)
        captures = (
            capture_routing(layer, self.model.top_k, routing),
            capture_branches(layer, branches),
            capture_heads(attention_child, heads),
        )
        out, args, kwargs = forward(*(captures if extras else ()))
        found = floor_routing(routing)
        parts = head_parts(heads, out.shape)
        if parts:  # sketched: a few kilobytes per head (compare.sketch)
            found[HEADS_KEY] = unit_sketches(parts).to(self.golden_dtype)
        del heads, parts
        hidden_in = upcast.get(hidden_input_name(spec))
        for name, branch in contribution_branches(branches, out, hidden_in).items():  # directions: golden's dtype
            found[BRANCH_PREFIX + name] = branch.to("cpu", self.golden_dtype)
        attention = next((name for name in branches if direction_part(name) == "attention"), None)
        del branches
        if extras:

            def again() -> torch.Tensor:
                return forward()[0]

            def keep(name: str, direction: torch.Tensor | None) -> None:
                """A direction stored in the golden's dtype; the floor's copy goes with the call
                (one at a time)."""
                if direction is not None:
                    found[BRANCH_PREFIX + name] = direction.to("cpu", self.golden_dtype)

            def keep_stepped(name: str, stepped: tuple[torch.Tensor, float] | None) -> None:
                """A direction and its move per unit of its change (``STEP_PREFIX``)."""
                if stepped is not None:
                    keep(name, stepped[0])
                    found[STEP_PREFIX + name] = torch.tensor(stepped[1], dtype=torch.float32)

            keep_stepped(TEMPERATURE_BRANCH, temperature_direction(again, out, MAX_BRANCH_OUTPUT_COSINE))
            # moves no check measures, for the detection limits alone (compare.sight)
            sights = [(NORM_EPSILON_FACTOR, epsilon_factor_direction(layer, again, out, MAX_BRANCH_OUTPUT_COSINE))]
            if attention is not None:
                module = layer.get_submodule(attention)
                sights.append((ATTENTION_SCALE, branch_scale_direction(module, again, out, MAX_BRANCH_OUTPUT_COSINE)))
            for name, stepped in sights:
                if stepped is not None:
                    found[SIGHT_PREFIX + name] = stepped[0].to("cpu", self.golden_dtype)
                    found[STEP_PREFIX + name] = torch.tensor(stepped[1], dtype=torch.float32)
            # the epsilon's step is set by the layer's input, far outside a q/k norm's or a
            # post-norm's linear range on a trained model: its direction only, no size per unit
            epsilon = norm_epsilon_direction(layer, hidden_in, again, out, MAX_BRANCH_OUTPUT_COSINE)
            keep(NORM_EPSILON_BRANCH, epsilon[0] if epsilon is not None else None)
            gelu = gelu_form_direction(layer, again, out, MAX_BRANCH_OUTPUT_COSINE)
            if gelu is not None:  # the swap is a bug's whole effect: its size kept (compare.verdict.KERNEL_LEAN)
                keep(GELU_FORM_BRANCH, gelu[0])
                found[MOVE_PREFIX + GELU_FORM_BRANCH] = torch.tensor(gelu[1], dtype=torch.float32)
            # moves no check measures, for the diagnosis alone (compare.diagnosis)
            causes = norm_weight_directions(layer, again, out, MAX_BRANCH_OUTPUT_COSINE)
            causes[NORM_BIAS_CAUSE] = norm_bias_direction(layer, again, out, MAX_BRANCH_OUTPUT_COSINE)
            causes.update(inner_attention_directions(layer, again, out, MAX_BRANCH_OUTPUT_COSINE))
            stored = [v for k, v in found.items() if k.startswith(BRANCH_PREFIX)]
            kept = distinct_moves({k: v for k, v in causes.items() if v is not None}, stored)
            for name, direction in kept.items():
                found[CAUSE_PREFIX + name] = direction.to("cpu", self.golden_dtype)
        appended = appended_kv(args, kwargs, spec, upcast) if extras else None
        if appended is not None:
            found[FLOOR_NEW_KEYS], found[FLOOR_NEW_VALUES] = (t.detach().to("cpu", self.dtype) for t in appended)
        del args, kwargs, upcast
        if owned:
            del layer
        give_back_memory()  # the wider pass's freed temporaries (and the layer, when owned)
        return out.detach().to("cpu", self.dtype), found
