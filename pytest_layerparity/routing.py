"""Mixture-of-experts routing: find a layer's routers, record which experts each token
went to, and measure how golden and target agree.

Routers are recognised by what they return, not by architecture: a submodule named like a
router or gate whose output holds a 2-D integer tensor (tokens x top-k, the chosen experts)
and a 2-D float tensor (tokens x experts, the logits), as transformers' ``*TopKRouter``
modules do; a bare linear ``gate`` returning logits is read with top-k taken from the config.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_NAME_HINTS = ("router", "gate")


def _looks_like_router(name: str, module: torch.nn.Module) -> bool:
    leaf = name.rsplit(".", 1)[-1].lower()
    cls = type(module).__name__.lower()
    if "proj" in leaf or "norm" in leaf:
        return False
    return any(h in cls for h in _NAME_HINTS) or leaf in ("gate", "router")


def _parse(output: Any, top_k: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(logits, indices) from a router's output, or None when it is not one."""
    items = list(output) if isinstance(output, (tuple, list)) else [output]
    tensors = [t for t in items if isinstance(t, torch.Tensor) and t.dim() == 2]
    ints = [t for t in tensors if not torch.is_floating_point(t)]
    floats = [t for t in tensors if torch.is_floating_point(t)]
    if ints and floats:
        indices = ints[0]
        logits = next((f for f in floats if f.shape[0] == indices.shape[0] and f.shape[1] >= indices.shape[1]), None)
        return (logits, indices) if logits is not None else None
    if floats and top_k and len(items) == 1 and floats[0].shape[-1] > top_k:
        logits = floats[0]
        return logits, torch.topk(logits, top_k, dim=-1).indices
    return None


class _TopkInputs(TorchFunctionMode):
    """Records the scores a router hands to ``torch.topk``: the values its choice is made
    on (e.g. sigmoid(logits) + bias), whatever the architecture computes them from."""

    def __init__(self) -> None:
        super().__init__()
        self.scores: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk) and args:
            self.scores.append(args[0].detach())
        return func(*args, **kwargs)


@contextmanager
def capture_routing(layer: torch.nn.Module, top_k: int | None, sink: dict[str, torch.Tensor]) -> Iterator[None]:
    """While the block runs, store each router's ``routing.<name>.logits``, ``.indices`` and,
    where it chose with torch.topk, ``.scores`` (CPU copies) into ``sink``."""
    handles = []
    active: dict[str, _TopkInputs] = {}

    def pre(name: str):
        def enter(module: torch.nn.Module, args: tuple) -> None:
            mode = _TopkInputs()
            mode.__enter__()
            active[name] = mode

        return enter

    def post(name: str):
        def record(module: torch.nn.Module, args: tuple, output: Any) -> None:
            mode = active.pop(name, None)
            if mode is not None:
                mode.__exit__(None, None, None)
            parsed = _parse(output, top_k)
            if parsed is None:
                return
            logits, indices = parsed
            sink[f"routing.{name}.logits"] = logits.detach().float().to("cpu", copy=True)
            sink[f"routing.{name}.indices"] = indices.detach().to("cpu", torch.int64, copy=True)
            scores = [sc for sc in (mode.scores if mode else []) if tuple(sc.shape) == tuple(logits.shape)]
            if scores:
                sink[f"routing.{name}.scores"] = scores[-1].double().to("cpu", copy=True)

        return record

    try:
        for name, module in layer.named_modules():
            if name and _looks_like_router(name, module):
                handles.append(module.register_forward_pre_hook(pre(name)))
                handles.append(module.register_forward_hook(post(name)))
        yield
    finally:
        for mode in active.values():  # a forward that raised inside a router
            mode.__exit__(None, None, None)
        for handle in handles:
            handle.remove()


def router_names(tensors: dict[str, Any]) -> list[str]:
    return sorted({key[len("routing."):-len(".indices")] for key in tensors if key.startswith("routing.") and key.endswith(".indices")})


def ref_routing(sink: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The logits and choice scores of a higher-precision run, renamed ``ref_routing.<router>.*``."""
    return {f"ref_{k}": v for k, v in sink.items() if k.endswith((".logits", ".scores"))}


@dataclass(frozen=True)
class RoutingAgreement:
    """How the target's expert choices agree with the golden's, for one router."""

    router: str
    tokens: int
    agreement: float  # share of tokens with the same expert set
    flipped: int
    near_tie_flipped: int
    flipped_tokens: tuple[int, ...]
    near_tie_tokens: tuple[int, ...]

    def describe(self) -> str:
        if not self.flipped:
            return f"routing ({self.router}): all {self.tokens} tokens chose the same experts"
        other = self.flipped - self.near_tie_flipped
        text = f"routing ({self.router}): {self.flipped} of {self.tokens} tokens chose other experts"
        parts = []
        if self.near_tie_flipped:
            parts.append(f"routing flipped on {self.near_tie_flipped} near-tie tokens (router margin within the dtype's noise)")
        if other:
            parts.append(f"{other} flipped without a near tie (a routing bug?)")
        return text + ": " + "; ".join(parts)


def tie_margin(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Per token: the gap between the k-th and (k+1)-th largest router logit, relative to
    the largest magnitude of that token's logits."""
    values = torch.topk(logits.double(), min(top_k + 1, logits.shape[-1]), dim=-1).values
    if values.shape[-1] <= top_k:
        return torch.full((logits.shape[0],), float("inf"), dtype=torch.float64)
    scale = logits.double().abs().amax(dim=-1).clamp_min(1e-30)
    return (values[:, top_k - 1] - values[:, top_k]) / scale


def _pair_margin(ref_logits: torch.Tensor, golden_set: set[int], target_set: set[int]) -> float:
    """The smallest exact-logit gap between an expert only the golden chose and one only the
    target chose: how close the decision between them really was."""
    only_g, only_t = golden_set - target_set, target_set - golden_set
    return min(abs(float(ref_logits[a]) - float(ref_logits[b])) for a in only_g for b in only_t)


def agreement(router: str, golden: dict[str, torch.Tensor], target: dict[str, torch.Tensor], tie_tolerance: float,
              tie_factor: float = 4.0) -> RoutingAgreement | None:
    """Agreement of one router. A flipped token is a near tie when the exact (higher
    precision) choice scores of the experts that swapped differ by no more than
    ``tie_factor`` times the golden's own rounding error of that token's scores; goldens
    without the exact scores fall back to the relative logit margin ``tie_tolerance``."""
    key = f"routing.{router}"
    if f"{key}.indices" not in target or f"{key}.indices" not in golden:
        return None
    g_idx = golden[f"{key}.indices"].sort(dim=-1).values
    t_idx = target[f"{key}.indices"].sort(dim=-1).values
    if g_idx.shape != t_idx.shape:
        return None
    same = (g_idx == t_idx).all(dim=-1)
    flipped = [int(i) for i in (~same).nonzero().flatten()]
    kind = "scores" if f"{key}.scores" in golden and f"ref_routing.{router}.scores" in golden else "logits"
    g_logits = golden[f"{key}.{kind}"].double()
    ref_logits = golden.get(f"ref_routing.{router}.{kind}")
    near = []
    if ref_logits is not None and ref_logits.shape == g_logits.shape:
        ref_logits = ref_logits.double()
        noise = (g_logits - ref_logits).abs().amax(dim=-1)
        for j in flipped:
            margin = _pair_margin(ref_logits[j], set(g_idx[j].tolist()), set(t_idx[j].tolist()))
            if margin <= tie_factor * float(noise[j]):
                near.append(j)
    else:
        margin = tie_margin(g_logits, g_idx.shape[-1])
        near = [j for j in flipped if float(margin[j]) <= tie_tolerance]
    tokens = int(same.numel())
    return RoutingAgreement(
        router=router, tokens=tokens, agreement=float(same.double().mean()) if tokens else 1.0,
        flipped=len(flipped), near_tie_flipped=len(near),
        flipped_tokens=tuple(flipped), near_tie_tokens=tuple(near),
    )
