"""Mixture-of-experts routing, judged: how the target's expert choices agree with the
golden's, and which flipped tokens were near ties (a decision within the dtype's noise)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def router_names(tensors: dict[str, Any]) -> list[str]:
    return sorted(
        {
            key[len("routing.") : -len(".indices")]
            for key in tensors
            if key.startswith("routing.") and key.endswith(".indices")
        }
    )


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
            parts.append(
                f"routing flipped on {self.near_tie_flipped} near-tie tokens (router margin within the dtype's noise)"
            )
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
    target chose: how close the decision between them really was (0 between equal scores; a
    masked-out candidate, -1, scores -inf)."""

    def score(i: int) -> float:
        return float(ref_logits[i]) if i >= 0 else float("-inf")

    only_g, only_t = golden_set - target_set, target_set - golden_set
    return min(0.0 if score(a) == score(b) else abs(score(a) - score(b)) for a in only_g for b in only_t)


def _masked_out(scores: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``indices`` with the candidates whose score is -inf (masked out: a causal indexer's top-k
    of an early query takes some) replaced by -1, so that which of them a top-k took, an
    implementation's choice among equals that changes nothing, is no flip."""
    picked = scores.gather(-1, indices.clamp_min(0))
    return torch.where(torch.isneginf(picked), torch.full_like(indices, -1), indices)


def _score_kind(golden: dict[str, torch.Tensor], router: str) -> str:
    """Which of a router's records its near ties are judged on: its choice scores where the
    golden holds them and their floor, else its logits."""
    key = f"routing.{router}.scores"
    return "scores" if key in golden and f"floor.{key}" in golden else "logits"


def _largest_finite(distances: torch.Tensor) -> torch.Tensor:
    """Per token (row), the largest finite distance (0 where there is none)."""
    return torch.where(distances.isfinite(), distances, torch.zeros_like(distances)).amax(dim=-1)


def agreement(
    router: str,
    golden: dict[str, torch.Tensor],
    target: dict[str, torch.Tensor],
    tie_tolerance: float,
    tie_factor: float = 4.0,
) -> RoutingAgreement | None:
    """Agreement of one router. A flipped token is a near tie when the exact (higher
    precision) choice scores of the experts that swapped differ by no more than
    ``tie_factor`` times the golden's own rounding error of that token's scores, or in a
    chain the perturbed chains' drift of them (``drift.routing.<router>.*``, see
    :func:`fold_drift`), whichever is larger; goldens without the exact scores fall back to
    the relative logit margin ``tie_tolerance``."""
    key = f"routing.{router}"
    if f"{key}.indices" not in target or f"{key}.indices" not in golden:
        return None
    g_idx, t_idx = golden[f"{key}.indices"], target[f"{key}.indices"]
    if g_idx.shape != t_idx.shape:
        return None
    kind = _score_kind(golden, router)
    g_logits = golden[f"{key}.{kind}"].double()
    if g_logits.shape[0] == g_idx.shape[0]:
        g_idx, t_idx = _masked_out(g_logits, g_idx), _masked_out(g_logits, t_idx)
    g_idx, t_idx = g_idx.sort(dim=-1).values, t_idx.sort(dim=-1).values
    same = (g_idx == t_idx).all(dim=-1)
    flipped = [int(i) for i in (~same).nonzero().flatten()]
    ref_logits = golden.get(f"floor.routing.{router}.{kind}")
    near = []
    if ref_logits is not None and ref_logits.shape == g_logits.shape:
        ref_logits = ref_logits.double()
        error = (g_logits - ref_logits).abs()
        noise = _largest_finite(error)
        drift = golden.get(f"drift.{key}.{kind}")
        if drift is not None and drift.shape == noise.shape:
            noise = torch.maximum(noise, drift.double())
        for j in flipped:
            margin = _pair_margin(ref_logits[j], set(g_idx[j].tolist()), set(t_idx[j].tolist()))
            if margin <= tie_factor * float(noise[j]):
                near.append(j)
    else:
        margin = tie_margin(g_logits, g_idx.shape[-1])
        near = [j for j in flipped if float(margin[j]) <= tie_tolerance]
    tokens = int(same.numel())
    return RoutingAgreement(
        router=router,
        tokens=tokens,
        agreement=float(same.double().mean()) if tokens else 1.0,
        flipped=len(flipped),
        near_tie_flipped=len(near),
        flipped_tokens=tuple(flipped),
        near_tie_tokens=tuple(near),
    )


def golden_floor_flips(golden: dict[str, torch.Tensor]) -> tuple[int, ...]:
    """Tokens whose experts the golden chose otherwise than its floor's exact scores
    (``floor.routing.<router>.*``, the same call computed wider) choose them: the golden
    broke a near tie the other way. At such a token the golden's difference from its floor
    is an expert's whole contribution, not rounding: one such token outweighs hundreds of
    others in the golden's error, the unit every floor statistic is measured in, so the
    statistics leave it out (the envelope's runs and the target alike). A router whose
    choice is not the plain top-k of those scores (a grouped selection: more than half the
    tokens would differ) is left alone; so is a call where every token would go (a decode
    step's one token: its statistics would say nothing)."""
    out: set[int] = set()
    rows = 0
    for name in router_names(golden):
        key = f"routing.{name}"
        kind = _score_kind(golden, name)
        exact, indices = golden.get(f"floor.routing.{name}.{kind}"), golden[f"{key}.indices"]
        rows = indices.shape[0]
        if exact is None or exact.dim() != 2 or indices.dim() != 2 or exact.shape[0] != indices.shape[0]:
            continue
        chosen = exact.double().topk(min(indices.shape[-1], exact.shape[-1]), dim=-1).indices
        found = agreement(name, golden, {f"{key}.indices": chosen}, 0.0)
        if found is not None and 2 * found.flipped <= found.tokens:
            out.update(found.flipped_tokens)
    return tuple(sorted(out)) if len(out) < rows else ()


def fold_drift(
    golden: dict[str, torch.Tensor], routing: dict[str, torch.Tensor], drift: dict[str, torch.Tensor]
) -> None:
    """Fold one perturbed chain's router records into ``drift``: per router, per token, the
    largest distance of any expert's choice score (and logit) from the golden's, the largest
    over the chains folded so far (``drift.routing.<router>.<kind>``). A chain feeds each
    router an input that legitimate arithmetic has moved over the layers before it, which
    moves its scores by more than the one layer's rounding the isolated near-tie test
    allows: a target chain's flip within that drift is a near tie too (:func:`agreement`)."""
    for name in router_names(golden):
        for kind in ("scores", "logits"):
            key = f"routing.{name}.{kind}"
            mine, theirs = golden.get(key), routing.get(key)
            if mine is None or theirs is None or mine.shape != theirs.shape or mine.dim() != 2:
                continue
            gap = _largest_finite((theirs.double() - mine.double()).abs())
            before = drift.get(f"drift.{key}")
            drift[f"drift.{key}"] = gap if before is None else torch.maximum(before, gap)
