"""Whole-model parity: the next-token distributions of the target against the golden's,
position by position. Pure arithmetic on tensors, like the layer judge.

The golden keeps its logits compact (:func:`compact_logits`): per position the top-k token
ids and logits and the log-sum-exp of all of them, enough for the checks below at a small
fraction of a vocabulary-wide tensor. What the target is held to:

* **top-1 agreement**: the share of positions whose greedy token is the golden's. A flip where
  the golden's own top-2 margin is within rounding (at most the most a legitimately perturbed
  run's greedy margin shrank at any position, or a few units of the dtype's rounding of the
  top logit) is a near tie: reported, not failed. Any other flip fails. The perturbed runs
  also take their own choice among exactly equal top-k candidates inside the layers (a
  sparse indexer's keys scored 0, which another backend's top-k picks otherwise), so the
  flips that follow such a choice are within what they reach.
* **KL divergence** of the next-token distributions, KL(golden || target), on the golden's
  top-k tokens plus one bucket for the rest of the vocabulary (a lower bound of the full KL:
  merging outcomes never increases it). Its median over positions is held against the
  envelope of the same statistic over K perturbed reference runs (:class:`ModelEnvelope`),
  at the session's false-alarm rate. The median, not the mean: a legitimate near-tie flip of
  an MoE router changes the few positions after it by orders of magnitude more than rounding
  does, while a bug after the last layer (a final norm or LM head off) moves every position.
  The mean and the maximum are reported.
* **logit scale**: the slope of the target's logits on the golden's at each position's
  top-k tokens, centred (a constant added to a position's logits changes nothing), its mean
  over the middle half of the positions (a router's near-tie flip moves the few positions
  after it, not the rest, as for the KL's median): 1 for a target that computes what the
  golden does. A bug after the last layer that scales the logits (a final norm's weight,
  the LM head, a logit scaling or soft-capping left out) moves every position the same way,
  which the KL sees only in proportion to the logits' spread. Held to the range of {1, the
  perturbed runs' mean} widened by the Student-t quantile times their spread (at least what
  the golden dtype's rounding of the logits alone gives the slope), two-sided.
* **top-k overlap** (reported): the mean share of the golden's top-k among the target's.
* **first divergence** (reported): the first position whose greedy token differs, and
  whether it was a near tie.
* **greedy tokens before divergence** (reported, :func:`tokens_before_divergence`): how many
  of the golden's generated tokens (the prompt's next token and each decode step's) the
  target predicts before its first differing one. Up to that point a free-running greedy
  generation on the target feeds exactly the tokens teacher forcing feeds, so this is the
  free-running answer ("the target generates the golden's first n tokens") at no extra run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .envelope import _mean_sd, t_quantile
from .floor import row_blocks
from .verdict import Check

TOPK_IDS = "topk_ids"
TOPK_LOGITS = "topk_logits"
LOGSUMEXP = "logsumexp"


#: Elements of logits widened at a time, a block of positions' rows of the vocabulary (in
#: float64 32 MB): a long prompt's logits are compacted and held to the golden's a block at a
#: time, not as a float64 copy of every position's (2048 positions of a 128k vocabulary: 2 GB,
#: and as much again for their log-softmax, beside logits the memory plan counts once).
BLOCK_ELEMENTS = 1 << 22


def _position_blocks(logits: torch.Tensor) -> tuple[torch.Tensor, list[slice]]:
    """``logits`` as rows [positions, vocab] and the blocks of rows to take at a time."""
    rows = logits.detach().reshape(-1, logits.shape[-1])
    return rows, row_blocks(rows, BLOCK_ELEMENTS)


def compact_logits(logits: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """``logits`` [..., vocab] kept as the top-k ids (int32) and logits (float32) and the
    log-sum-exp (float32) per position (a block of positions at a time)."""
    rows, blocks = _position_blocks(logits)
    k = min(k, rows.shape[-1])
    values, ids, lse = [], [], []
    for block in blocks:
        wide = rows[block].float()
        top = wide.topk(k, dim=-1)
        values.append(top.values)
        ids.append(top.indices.to(torch.int32))
        lse.append(torch.logsumexp(wide, dim=-1))
        del wide, top
    lead = tuple(logits.shape[:-1])
    return {
        TOPK_IDS: torch.cat(ids).reshape(*lead, k),
        TOPK_LOGITS: torch.cat(values).reshape(*lead, k),
        LOGSUMEXP: torch.cat(lse).reshape(lead),
    }


@dataclass(frozen=True)
class LogitsStats:
    """One set of logits against the golden's, over ``positions`` positions."""

    positions: int
    kl_median: float
    kl_mean: float
    kl_max: float
    top1_agreement: float
    topk_overlap: float
    flipped: list[int]  # flat positions whose greedy token is not the golden's
    margins: list[float]  # the golden's top-2 margin at each flipped position
    logit_scale: float = 1.0  # the slope of its centred top-k logits on the golden's, middle half of positions
    margin_drift: float = 0.0  # the most a position's greedy margin shrank from the golden's top-2 margin

    @property
    def first_divergence(self) -> int | None:
        return self.flipped[0] if self.flipped else None


def logits_stats(golden: Mapping[str, torch.Tensor], logits: torch.Tensor) -> LogitsStats:
    """``logits`` [..., vocab] (any device, any float dtype) against the compact ``golden``,
    a block of positions at a time in float64 on the CPU."""
    ids = golden[TOPK_IDS].long().reshape(-1, golden[TOPK_IDS].shape[-1])
    top = golden[TOPK_LOGITS].float().reshape(ids.shape)
    lse = golden[LOGSUMEXP].float().reshape(-1)
    rows, blocks = _position_blocks(logits)
    if rows.shape[0] != ids.shape[0]:
        raise ValueError(f"the target gave logits for {rows.shape[0]} positions, the golden holds {ids.shape[0]}")
    log_p = top.double() - lse.double()[:, None]
    k = ids.shape[-1]
    kl_parts, greedy_parts, overlap_parts, at_topk, gap_parts = [], [], [], [], []
    for block in blocks:
        target, want, lp = rows[block].to("cpu", torch.float64), ids[block], log_p[block]
        log_q = torch.log_softmax(target, dim=-1).gather(-1, want)
        p_rest = (1 - lp.exp().sum(-1)).clamp_min(0)
        q_rest = (1 - log_q.exp().sum(-1)).clamp_min(1e-300)
        rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-300).log() - q_rest.log()), 0.0)
        kl_parts.append((lp.exp() * (lp - log_q)).sum(-1) + rest)
        greedy_parts.append(target.argmax(-1))
        best, target_top = target.topk(k, dim=-1)
        overlap_parts.append((target_top[:, :, None] == want[:, None, :]).any(-1).double().mean(-1))
        at_topk.append(target.gather(-1, want))
        if k > 1:  # the golden's greedy token's logit over the best other one's
            gap_parts.append(at_topk[-1][:, 0] - torch.where(target_top[:, 0] == want[:, 0], best[:, 1], best[:, 0]))
        del target, log_q
    kl, greedy, overlap = torch.cat(kl_parts), torch.cat(greedy_parts), torch.cat(overlap_parts)
    flipped = (greedy != ids[:, 0]).nonzero().flatten().tolist()
    gap = (top[:, 0] - top[:, 1]).double() if k > 1 else None  # the golden's greedy margin
    margins = gap.tolist() if gap is not None else [math.inf] * ids.shape[0]
    drift = gap - torch.cat(gap_parts) if gap is not None else None
    kl = kl.clamp_min(0)
    g, spread = _centred(top.double())
    t, _ = _centred(torch.cat(at_topk))
    slopes = ((t * g).sum(-1) / spread)[spread > 0]
    return LogitsStats(
        positions=ids.shape[0],
        kl_median=float(kl.median()),
        kl_mean=float(kl.mean()),
        kl_max=float(kl.max()),
        top1_agreement=1 - len(flipped) / ids.shape[0],
        topk_overlap=float(overlap.mean()),
        flipped=flipped,
        margins=[margins[i] for i in flipped],
        logit_scale=_middle_mean(slopes),
        margin_drift=float(drift.max()) if drift is not None else 0.0,
    )


def _centred(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row less its mean, and each centred row's sum of squares."""
    centred = rows - rows.mean(-1, keepdim=True)
    return centred, (centred * centred).sum(-1)


def _middle_mean(values: torch.Tensor) -> float:
    """The mean of the middle half of ``values`` (1.0 where there are none)."""
    if not values.numel():
        return 1.0
    ordered = values.sort().values
    cut = values.numel() // 4
    return float(ordered[cut : values.numel() - cut].mean())


def scale_rounding_sd(golden: Mapping[str, torch.Tensor], dtype: str) -> float:
    """The standard deviation of :attr:`LogitsStats.logit_scale` from the golden dtype's
    rounding of the logits alone (each logit off by a uniform error within half an ulp),
    taken as the positions' median's (a little more than their middle half's mean): the
    least spread the scale's limits assume."""
    u = float(torch.finfo(getattr(torch, dtype)).eps) / 2  # the unit roundoff
    top = golden[TOPK_LOGITS].double().reshape(-1, golden[TOPK_LOGITS].shape[-1])
    g, spread = _centred(top)
    kept = spread > 0
    if not bool(kept.any()):
        return 0.0
    each = u / math.sqrt(3) * (g * g * top * top).sum(-1)[kept].sqrt() / spread[kept]  # one position's slope
    return float(each.median()) * math.sqrt(math.pi / 2) / math.sqrt(int(kept.sum()))


@dataclass(frozen=True)
class ModelEnvelope:
    """What K legitimately perturbed reference runs of the whole model reached: the median
    KL of each run, the golden margins at which runs flipped a greedy token and how far
    each run's greedy margins shrank at most."""

    kl_median: tuple[float, ...]
    flip_margins: tuple[float, ...]
    # each run's logit scale and largest margin drift (empty in an envelope made before it was kept)
    logit_scale: tuple[float, ...] = ()
    margin_drift: tuple[float, ...] = ()

    @property
    def samples(self) -> int:
        return len(self.kl_median)

    @classmethod
    def from_stats(cls, runs: Sequence[LogitsStats]) -> ModelEnvelope:
        return cls(
            tuple(r.kl_median for r in runs),
            tuple(m for r in runs for m in r.margins),
            tuple(r.logit_scale for r in runs),
            tuple(r.margin_drift for r in runs),
        )

    def first(self, k: int) -> ModelEnvelope:
        """The envelope of the first ``k`` runs (the flip margins of all of them)."""
        return ModelEnvelope(self.kl_median[:k], self.flip_margins, self.logit_scale[:k], self.margin_drift[:k])

    def as_metadata(self) -> dict[str, Any]:
        runs = {"logit_scale": self.logit_scale, "margin_drift": self.margin_drift}
        kept = {key: list(values) for key, values in runs.items() if values}
        return {"kl_median": list(self.kl_median), "flip_margins": list(self.flip_margins), **kept}

    @classmethod
    def from_metadata(cls, data: Mapping[str, Any] | None) -> ModelEnvelope | None:
        if not data:
            return None
        try:
            kl = tuple(float(v) for v in data["kl_median"])
            margins = tuple(float(v) for v in data["flip_margins"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed whole-model envelope ({exc!r})") from exc
        if len(kl) < 2 or any(not math.isfinite(v) or v < 0 for v in kl):
            raise ValueError("malformed whole-model envelope: needs 2 or more finite, non-negative KL samples")
        scale, drift = (_per_run(data, key, len(kl)) for key in ("logit_scale", "margin_drift"))
        return cls(kl, margins, scale, drift)

    def _rate(self, false_alarm_rate: float) -> float:
        """The rate each statistic gets: the session's split over the KL and the logit scale."""
        return false_alarm_rate / (2 if self.logit_scale else 1)

    def kl_limit(self, false_alarm_rate: float) -> float:
        """The prediction limit of a correct target's median KL (on the log scale, as the
        noise ratios' limits)."""
        k = self.samples
        mean, sd = _mean_sd([math.log(max(v, 1e-300)) for v in self.kl_median])
        q = t_quantile(1 - self._rate(false_alarm_rate), k - 1)
        return math.exp(min(mean + q * sd * math.sqrt(1 + 1 / k), 700.0))

    @property
    def tie_margin(self) -> float:
        """The largest golden margin a flip may have and be a near tie: the most any run's
        greedy margin shrank anywhere, flipped or not (a correct target's logits move as much
        elsewhere, and flip there where the margin is as small)."""
        return max((*self.flip_margins, *self.margin_drift), default=0.0)

    def scale_range(self, false_alarm_rate: float, least_sd: float) -> tuple[float, float] | None:
        """The range a correct target's logit scale is held to (None without the runs' own):
        {1, the runs' mean} widened on each side by the t quantile times their spread (at
        least ``least_sd``: the golden's own rounding)."""
        if len(self.logit_scale) < 2:
            return None
        k = len(self.logit_scale)
        mean, sd = _mean_sd(list(self.logit_scale))
        half = t_quantile(1 - self._rate(false_alarm_rate) / 2, k - 1) * max(sd, least_sd) * math.sqrt(1 + 1 / k)
        return min(1.0, mean) - half, max(1.0, mean) + half


def _per_run(data: Mapping[str, Any], key: str, runs: int) -> tuple[float, ...]:
    """An envelope's optional figure of each run (``key``: none, or one finite number a run)."""
    try:
        values = tuple(float(v) for v in data.get(key, ()))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed whole-model envelope: {key} ({exc!r})") from exc
    if values and (len(values) != runs or not all(map(math.isfinite, values))):
        raise ValueError(f"malformed whole-model envelope: {key} does not match the runs")
    return values


@dataclass
class ModelOutcome:
    """The whole model's logits on the target against the golden's."""

    stats: LogitsStats
    checks: list[Check]
    near_ties: list[int] = field(default_factory=list)  # flipped positions within rounding (reported)
    hard_flips: list[int] = field(default_factory=list)  # flipped positions outside it (failed)
    kl_limit: float | None = None
    kl_reached: float | None = None  # the largest median KL of a perturbed reference run
    scale_range: tuple[float, float] | None = None  # what the logit scale is held to
    tie_margin: float = 0.0
    samples: int = 0
    generated: int = 0  # tokens the golden generated (the prompt's next token, then each decode step's)
    generated_matched: int = 0  # of those, how many the target's greedy tokens give before the first flip

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks)


def tokens_before_divergence(flipped: Sequence[int], batch: int, prompt: int, steps: int) -> int:
    """Of the ``steps + 1`` tokens generated after a ``prompt``-token prompt (flat positions
    ``row * (prompt + steps) + prompt - 1 + j``), how many the target's greedy tokens match
    before the first flip, in the worst of the ``batch`` rows."""
    flips, firsts = set(flipped), [row * (prompt + steps) + prompt - 1 for row in range(batch)]
    return min((next((j for j in range(steps + 1) if f + j in flips), steps + 1) for f in firsts), default=0)


def judge_logits(
    golden: Mapping[str, torch.Tensor],
    logits: torch.Tensor,
    dtype: str,
    tie_tolerance: float,
    false_alarm_rate: float,
    envelope: ModelEnvelope | None = None,
) -> ModelOutcome:
    """Hold the target's ``logits`` against the compact ``golden`` (see the module's
    docstring). ``tie_tolerance``: relative margin below which a flip is a near tie."""
    finite = bool(torch.isfinite(logits).all())
    stats = logits_stats(golden, logits)
    top = golden[TOPK_LOGITS].float().reshape(stats.positions, -1)[:, 0]
    envelope_margin, near, hard = envelope.tie_margin if envelope is not None else 0.0, [], []
    for position, margin in zip(stats.flipped, stats.margins, strict=True):
        bound = max(envelope_margin, tie_tolerance * abs(float(top[position])))
        (near if margin <= bound else hard).append(position)
    checks = [
        Check("logits_nan_inf", 0 if finite else 1, "==", 0, finite),
        Check("greedy_flips_outside_ties", len(hard), "==", 0, not hard),
    ]
    kl_limit = scale_range = None
    if envelope is not None:
        kl_limit = envelope.kl_limit(false_alarm_rate)
        checks.append(Check("kl_divergence_median", stats.kl_median, "<=", kl_limit, stats.kl_median <= kl_limit))
        scale_range = envelope.scale_range(false_alarm_rate, scale_rounding_sd(golden, dtype))
    if scale_range is not None:
        low, high = scale_range
        ok = low <= stats.logit_scale <= high
        checks.append(Check("logit_scale", stats.logit_scale, "in", high, ok, low=low))
    return ModelOutcome(
        stats=stats,
        checks=checks,
        near_ties=near,
        hard_flips=hard,
        kl_limit=kl_limit,
        kl_reached=max(envelope.kl_median) if envelope is not None else None,
        scale_range=scale_range,
        tie_margin=envelope_margin,
        samples=envelope.samples if envelope is not None else 0,
        **_generation(golden, stats),
    )


def _generation(golden: Mapping[str, torch.Tensor], stats: LogitsStats) -> dict[str, int]:
    """``generated`` and ``generated_matched`` where the golden holds its token ids."""
    prompt_ids = golden.get("input_ids")
    if prompt_ids is None or prompt_ids.dim() != 2:
        return {}
    decode_ids = golden.get("decode_ids")
    steps = decode_ids.shape[-1] if decode_ids is not None else 0
    batch, prompt = prompt_ids.shape
    if batch * (prompt + steps) != stats.positions:
        return {}
    return {
        "generated": steps + 1,
        "generated_matched": tokens_before_divergence(stats.flipped, batch, prompt, steps),
    }


def describe_model_outcome(outcome: ModelOutcome, where: str) -> str:
    """The failure text of the whole-model test."""
    s = outcome.stats
    lines = [f"whole model {where}: next-token distributions differ from the golden's ({s.positions} positions)"]
    lines += [f"  {c.describe()}" for c in outcome.checks]
    lines.append(
        f"  top-1 agreement {s.top1_agreement:.4f}, top-k overlap {s.topk_overlap:.4f}, "
        f"KL median {s.kl_median:.3g} (mean {s.kl_mean:.3g}, max {s.kl_max:.3g})"
    )
    if s.first_divergence is not None:
        kind = "a near tie" if s.first_divergence in outcome.near_ties else "not a near tie"
        lines.append(f"  first divergence: position {s.first_divergence} ({kind})")
    if outcome.generated:
        lines.append(
            f"  greedy generation: the target gives the golden's first {outcome.generated_matched} of "
            f"{outcome.generated} generated tokens"
        )
    if outcome.hard_flips:
        lines.append(f"  greedy token differs outside rounding at positions {outcome.hard_flips[:20]}")
    if outcome.near_ties:
        lines.append(f"  near ties (reported, not failed): positions {outcome.near_ties[:20]}")
    if outcome.kl_limit is not None:
        lines.append(
            f"  noise envelope from {outcome.samples} perturbed reference runs of the whole model: they reach "
            f"median KL {outcome.kl_reached:.3g} (limit {outcome.kl_limit:.3g}) and shrank or flipped greedy "
            f"margins by up to {outcome.tie_margin:.3g}"
        )
    return "\n".join(lines)
