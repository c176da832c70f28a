"""What a test could see: for each kind of error the golden stores a direction for, the
smallest size of it that the test's own checks fail on (its detection limit).

A kind of error moves the layer's output along a stored direction by an amount that grows
with its size: the attention's output scaled (``floor.sight.attention_scale``: the layer's
move measured at extraction, what the MLP after it answers and a post-norm undoes included;
older goldens: along the branch's own output), the MLP's output scaled (along the branch's own
output), the attention scores scaled (a softmax temperature; along the temperature's
direction), every norm's epsilon multiplied (``floor.sight.norm_epsilon``, measured at
x10: small beside any norm's input variance, where the verdict's own epsilon direction, its
step set by the layer's input, is far outside a q/k norm's or a post-norm's linear range),
GELU's other form (its stored move); each per unit of its size by ``floor.step.<name>``.
Every statistic the verdict judges is linear in the size or the square root of a quadratic in
it, so one pass over the output gives each statistic at any size; the verdict's own
:func:`~.verdict.evaluate` then says, at each size tried, whether the test would fail. The
limit is found on each side (raised and lowered; the epsilon raised) by growing the size and
bisecting the step that first fails.

The port under test is the base: what it already errs is in the statistics, so a pass states
what this port's test could have caught beyond its own error. A test that fails states what a
port that rounds as the reference did would have shown (the golden as the base): the failure
is seen; the limits still say how fine the layer's test is. The checks of the keys and values
a call writes are left out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .floor import FloorStats, element_sizes, row_blocks, token_floor
from .parts import direction_part

if TYPE_CHECKING:
    from ..options import Settings
    from .envelope import EnvelopeLimits
    from .metrics import Metrics

#: The kinds a test states its limits for, in the order the text names them, each with the
#: words of a change of size ``x`` (a fraction; the epsilon's a factor less one).
KINDS = ("attention_scale", "mlp_scale", "temperature", "norm_epsilon", "gelu_form")
WORDS = {
    "attention_scale": "attention output",
    "mlp_scale": "MLP output",
    "temperature": "attention scores' scale",
    "norm_epsilon": "norm epsilon",
    "gelu_form": "GELU's other form",
}
#: The largest size looked for: a scale or temperature off by the whole of itself, an epsilon
#: a million times the model's.
LARGEST = {"norm_epsilon": 1e6}
#: From these sizes on a kind counts as out of the test's sight: larger than such a port bug
#: is (a scale or temperature read wrong by a tenth, an epsilon read 100 times too large).
OUT_OF_SIGHT = {"norm_epsilon": 100.0}
SCALE_OUT_OF_SIGHT = 0.1
#: A branch's scale is stated only where the branches' outputs add up to the layer's own
#: contribution within this share of it (the stored directions are rounded to the golden's
#: dtype): a post-norm layer normalises each branch's output before adding it, so a scale of
#: the branch's output is no move of the layer's.
ADDITIVE = 0.05
#: The growth of the size between tries, and the bisections of the step that first fails: the
#: limit within 1.5**-8 of itself.
GROWTH = 1.5
BISECTIONS = 8
#: The size first tried: a move of this share of the golden's own error.
FIRST_MOVE = 0.01


@dataclass(frozen=True)
class Limit:
    """The smallest change of one kind the test fails on, raised (``high``) and lowered
    (``low``, a negative size), in the kind's measure: a fraction for a scale or temperature,
    None where no size up to ``LARGEST`` fails. GELU's other form has one size (1: the swap),
    seen or not. ``check``: the check that fails first when raised."""

    kind: str
    low: float | None
    high: float | None
    check: str = ""

    @property
    def both_ways(self) -> float | None:
        """The size from which a change either way is caught (the epsilon's: raised, as a
        factor over the model's)."""
        if self.kind in ("norm_epsilon", "gelu_form"):
            return self.high
        if self.low is None or self.high is None:
            return None
        return max(-self.low, self.high)

    @property
    def in_sight(self) -> bool:
        found = self.both_ways
        limit = OUT_OF_SIGHT.get(self.kind, SCALE_OUT_OF_SIGHT)
        return found is not None and (self.kind == "gelu_form" or found < limit)

    def describe(self) -> str:
        found = self.both_ways
        if found is None:
            return ""
        if self.kind == "gelu_form":
            return WORDS[self.kind]
        if self.kind == "norm_epsilon":
            return f"{WORDS[self.kind]} x{found:.3g}"
        return f"{WORDS[self.kind]} +-{100 * found:.2g}%"

    def missed(self) -> str:
        """The words of what the test does not see of this kind."""
        if self.kind == "gelu_form":
            return WORDS[self.kind]
        if self.kind == "norm_epsilon":
            return f"{WORDS[self.kind]} below x{OUT_OF_SIGHT[self.kind]:g}"
        return f"{WORDS[self.kind]} within +-{SCALE_OUT_OF_SIGHT:.0%}"


@dataclass(frozen=True)
class Sight:
    """A test's detection limits, per kind (``KINDS``' order), and the base they were
    measured on: "port" (the port's own output) or "reference" (the golden, for a failing
    test)."""

    limits: tuple[Limit, ...]
    base: str
    dtype: str

    def by_kind(self) -> dict[str, Limit]:
        return {limit.kind: limit for limit in self.limits}

    def properties(self, prefix: str = "") -> list[tuple[str, object]]:
        """JUnit's fields: ``detection_<kind>`` (a fraction; GELU's other form 1 where seen;
        absent where no size up to ``LARGEST`` is), ``detection_text`` the line."""
        found = [(f"{prefix}detection_{limit.kind}", limit.both_ways) for limit in self.limits]
        text = (f"{prefix}detection_text", self.describe())
        return [*((name, value) for name, value in found if value is not None), text]

    def describe(self) -> str:
        """One line: what the test sees, from which size, and what it does not."""
        seen = [limit.describe() for limit in self.limits if limit.in_sight]
        missed = [limit.missed() for limit in self.limits if not limit.in_sight]
        whose = "beyond the port's own error" if self.base == "port" else "in a port that rounds as the reference did"
        text = f"sees {', '.join(seen) if seen else 'none of the stored kinds'} ({whose})"
        if missed:
            text += f"; out of sight: {', '.join(missed)}"
            if self.dtype in ("bfloat16", "float16"):
                text += f" ({self.dtype}; float32 goldens, --dtype float32, round 2^16 times finer)"
        return text


@dataclass
class _Pass:
    """What one pass over the output gives: per token, the base's squared error against the
    floor and, per kind, its dot with the kind's move and the move's squared norm; the dots of
    each move with the layer's contribution and with each stored direction; and what the
    cosine with the golden takes."""

    err_g: list[torch.Tensor]
    err_t_sq: list[torch.Tensor]
    along: dict[str, list[torch.Tensor]]
    move_sq: dict[str, list[torch.Tensor]]
    with_contribution: dict[str, float]
    with_direction: dict[str, dict[str, float]]
    golden_dot: dict[str, float]
    base_dot: dict[str, float]
    ref_sq: float = 0.0  # in the per-token sums' units
    raw_g_sq: float = 0.0  # ||golden - ref||^2, unweighed: the unit of the biases
    gg: float = 0.0
    gt: float = 0.0
    tt: float = 0.0
    uu: float = 0.0
    dd: dict[str, float] = dataclasses.field(default_factory=dict)
    #: ||(ref - input) - the branches' outputs summed||^2: whether they add up to the layer's
    #: contribution (a pre-norm layer's do; a post-norm layer normalises them first)
    unexplained_sq: float = 0.0


def kind_moves(
    branches: Mapping[str, torch.Tensor],
    sights: Mapping[str, torch.Tensor],
    steps: Mapping[str, float],
    moves: Mapping[str, float],
) -> tuple[dict[str, tuple[torch.Tensor, float]], set[str]]:
    """Per kind, the stored tensor its move lies along and the move per unit of the kind's
    size as a multiple of it (a raised temperature scales the scores up: the other way from
    the stored softer step), and the kinds taken along a branch's own output (stated only where
    the branches add up to the layer's contribution). A kind without a stored direction is
    left out."""
    found: dict[str, tuple[torch.Tensor, float]] = {}
    for name, tensor in branches.items():
        part = direction_part(name)
        if part == "attention" and "attention_scale" not in found:
            found["attention_scale"] = (tensor, 1.0)
        elif part == "mlp" and name != "gelu_form" and "mlp_scale" not in found:
            found["mlp_scale"] = (tensor, 1.0)
    along_branches = set(found)
    for kind in ("attention_scale", "norm_epsilon"):  # measured at extraction: the layer's own move
        if kind in sights and kind in steps:
            found[kind] = (sights[kind], steps[kind])
            along_branches.discard(kind)
    if "attention_temperature" in branches and "attention_temperature" in steps:
        found["temperature"] = (branches["attention_temperature"], -steps["attention_temperature"])
    if "gelu_form" in branches and "gelu_form" in moves:
        found["gelu_form"] = (branches["gelu_form"], moves["gelu_form"])
    return found, along_branches


def _one_pass(
    golden: torch.Tensor,
    base: torch.Tensor,
    reference: torch.Tensor,
    hidden_in: torch.Tensor | None,
    keep: torch.Tensor | None,
    branches: Mapping[str, torch.Tensor],
    kinds: Mapping[str, tuple[torch.Tensor, float]],
    relative: bool = False,
) -> _Pass:
    """The sums :func:`sight` needs, a block of tokens at a time in float64 on the CPU; the
    per-token ones on errors weighed element by element where the verdict's ratios are
    (``relative``: :func:`.floor.element_sizes`)."""

    def rows(x: torch.Tensor) -> torch.Tensor:
        return x.detach().reshape(-1, x.shape[-1]).to("cpu")

    g, t, r = rows(golden), rows(base), rows(reference)
    x = rows(hidden_in) if hidden_in is not None and hidden_in.shape == golden.shape else None
    dirs = {name: rows(d) for name, d in branches.items() if d.shape == golden.shape}
    movers = {kind: rows(v) for kind, (v, _) in kinds.items()}
    found = _Pass([], [], {k: [] for k in movers}, {k: [] for k in movers}, dict.fromkeys(movers, 0.0), {}, {}, {})
    for kind in movers:
        found.with_direction[kind] = dict.fromkeys(dirs, 0.0)
        found.golden_dot[kind] = found.base_dot[kind] = 0.0
    for block in row_blocks(g, 1 << 18):
        kept = keep[block] if keep is not None else slice(None)

        def wide(a: torch.Tensor, block: slice = block, kept: torch.Tensor | slice = kept) -> torch.Tensor:
            return a[block].to(torch.float64)[kept]

        gb, tb, rb = wide(g), wide(t), wide(r)
        size = element_sizes(rb) if relative else 1.0
        et = (tb - rb) / size
        found.err_g.append(((gb - rb) / size).norm(dim=-1))
        found.err_t_sq.append(et.square().sum(-1))
        found.ref_sq += float((rb / size).square().sum())
        found.raw_g_sq += float((gb - rb).square().sum())
        found.gg += float(gb.square().sum())
        found.gt += float((gb * tb).sum())
        found.tt += float(tb.square().sum())
        u = None if x is None else rb - wide(x)
        db = {name: wide(d) for name, d in dirs.items()}
        if u is not None:
            found.uu += float(u.square().sum())
            summed = sum(
                (d for name, d in db.items() if direction_part(name) in ("attention", "mlp")), torch.zeros_like(u)
            )
            found.unexplained_sq += float((u - summed).square().sum())
        for name, d in db.items():
            found.dd[name] = found.dd.get(name, 0.0) + float(d.square().sum())
        for kind, v in movers.items():
            vb = wide(v) * kinds[kind][1]
            found.along[kind].append((et * vb / size).sum(-1))
            found.move_sq[kind].append((vb / size).square().sum(-1))
            found.golden_dot[kind] += float((gb * vb).sum())
            found.base_dot[kind] += float((tb * vb).sum())
            if u is not None:
                found.with_contribution[kind] += float((vb * u).sum())
            for name, d in db.items():
                found.with_direction[kind][name] += float((vb * d).sum())
    return found


def sight(
    golden: torch.Tensor,
    base: torch.Tensor,
    reference: torch.Tensor,
    base_stats: FloorStats,
    metrics: Metrics,
    settings: Settings,
    dtype: str,
    limits: EnvelopeLimits | None,
    *,
    hidden_in: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    branches: Mapping[str, torch.Tensor] | None = None,
    steps: Mapping[str, float] | None = None,
    moves: Mapping[str, float] | None = None,
    sights: Mapping[str, torch.Tensor] | None = None,
    relative: bool = False,
    base_name: str = "port",
) -> Sight | None:
    """The detection limits of a test whose output ``base`` (the port's, or the golden for a
    failing test) reads ``base_stats`` against the floor ``reference``: per kind of
    :func:`kind_moves`, the smallest change the verdict (:func:`~.verdict.evaluate` with the
    same settings and ``limits``) fails on. None where the golden stores no direction."""
    from .verdict import evaluate

    kinds, along_branches = kind_moves(branches or {}, sights or {}, steps or {}, moves or {})
    if not kinds or base_stats.golden_error <= 0:
        return None
    found = _one_pass(golden, base, reference, hidden_in, keep, branches or {}, kinds, relative)
    err_g = torch.cat(found.err_g)
    per_token_floor, tiny = token_floor(err_g, found.ref_sq)
    golden_error = float(err_g.norm())
    err_t_sq = torch.cat(found.err_t_sq)
    scale = (err_g.numel() * golden.shape[-1]) ** 0.5 / found.raw_g_sq**0.5
    along_tokens = {kind: torch.cat(parts) for kind, parts in found.along.items()}
    move_tokens = {kind: torch.cat(parts) for kind, parts in found.move_sq.items()}

    def stats_at(kind: str, x: float) -> tuple[FloorStats, float]:
        along, move_sq = along_tokens[kind], move_tokens[kind]
        per_token_sq = (err_t_sq + 2 * x * along + x * x * move_sq).clamp_min(0)
        per_token = per_token_sq.sqrt() / per_token_floor
        worst = int(per_token.argmax())
        target_error = float(per_token_sq.sum()) ** 0.5
        contribution_z = base_stats.contribution_z
        if contribution_z is not None and found.uu > 0:
            contribution_z += x * found.with_contribution[kind] / found.uu**0.5 * scale
        branch_z = {
            name: z + x * found.with_direction[kind].get(name, 0.0) / found.dd[name] ** 0.5 * scale
            for name, z in base_stats.branch_z.items()
            if found.dd.get(name, 0.0) > 0
        }
        stats = dataclasses.replace(
            base_stats,
            noise_ratio=target_error / (golden_error + tiny),
            token_noise_ratio=float(per_token[worst]),
            worst_token=worst,
            target_error=target_error,
            contribution_z=contribution_z,
            branch_z={**base_stats.branch_z, **branch_z},
        )
        moved_sq = found.tt + 2 * x * found.base_dot[kind] + x * x * float(move_sq.sum())
        cosine = (found.gt + x * found.golden_dot[kind]) / max((found.gg * max(moved_sq, 0.0)) ** 0.5, 1e-300)
        return stats, cosine

    def failing_check(kind: str, x: float) -> str | None:
        stats, cosine = stats_at(kind, x)
        checks = evaluate(metrics, settings, floor=stats, dtype=dtype, envelope=limits, cosine=cosine)
        return next((check.name for check in checks if not check.ok), None)

    additive = found.uu > 0 and found.unexplained_sq <= ADDITIVE**2 * found.uu
    out = []
    for kind in KINDS:
        if kind not in kinds or (kind in along_branches and not additive):
            continue
        if kind == "gelu_form":
            check = failing_check(kind, 1.0)
            out.append(Limit(kind, None, 1.0 if check else None, check or ""))
            continue
        move = float(move_tokens[kind].sum()) ** 0.5
        start = FIRST_MOVE * golden_error / move if move > 0 else math.inf
        largest = LARGEST.get(kind, 1.0)
        high, check = _smallest(lambda x, kind=kind: failing_check(kind, x), start, largest)
        low = None
        if kind == "norm_epsilon":
            high = 1 + high if high is not None else None  # a factor over the model's epsilon
        else:
            lowered, _ = _smallest(lambda x, kind=kind: failing_check(kind, -x), start, largest)
            low = -lowered if lowered is not None else None
        out.append(Limit(kind, low, high, check))
    return Sight(tuple(out), base_name, dtype)


def _smallest(fails: Callable[[float], str | None], start: float, largest: float) -> tuple[float | None, str]:
    """The smallest size from ``start`` up to ``largest`` that ``fails`` (the failing check's
    name, or None) fails on, by growing it ``GROWTH``-fold and bisecting the step that first
    fails (geometrically); (None, "") where none does."""
    below, size = 0.0, min(start, largest)
    check = fails(size)
    while check is None:
        if size >= largest:
            return None, ""
        below, size = size, min(size * GROWTH, largest)
        check = fails(size)
    for _ in range(BISECTIONS if below > 0 else 0):
        middle = (below * size) ** 0.5
        found = fails(middle)
        if found is None:
            below = middle
        else:
            size, check = middle, found
    return size, check
