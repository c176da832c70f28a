"""The noise envelope of a layer: what legitimate arithmetic does to each verdict statistic
of that layer, and the limits a target is held to.

At extraction the layer is run K times under Monte Carlo arithmetic (every rounded result
perturbed within its rounding error, see ``noise.perturb``); each run is a legitimate
implementation of the layer, and its statistics against the golden and the precision floor
(``noise_ratio``, ``token_noise_ratio``, ``contribution_bias``) are one sample of what a
correct port may show. The golden stores the samples; the verdict holds the target to
prediction limits drawn from them at a stated false-alarm rate:

* ratios (log-normal): ``exp(mean + q * sd * sqrt(1 + 1/K))`` of the samples' logarithms, at
  most ``REACHED_FACTOR`` times the largest sample (envelopes since rule 6); where a port is
  under test and a same-device control can run (the model's own layer beside it), at most
  ``CONTROLLED_REACH`` times the largest sample, or ``CONTROL_FACTOR`` times the control's
  value where that is larger (never past the first limit): the runs simulate the device's
  arithmetic, the control measures it;
* ``contribution_bias`` (the target's error along the layer's own contribution, relative to
  the floor, in noise units) and each ``branch_bias`` (the same along one branch's output):
  the span of {0 (the floor itself), the samples' mean, the golden's own bias} widened by
  ``q * sd * sqrt(1 + 1/K)`` on each side, with ``sd`` at least one noise unit;

where ``q`` is the Student-t quantile with K - 1 degrees of freedom that leaves ``rate / n``
beyond each ratio's limit and ``rate / 2n`` beyond each end of a bias's range (the rate split
over the n statistics: three, and one per branch).

A float16 layer's envelope holds a second family of K runs (``float32_sums``): the same
arithmetic with every float16 matmul's products summed in float32, as a target that sums them
so (Neuron, CUDA, eager CPU) does; its runs err several times less than those that may sum in
float16 (XLA's CPU backend). A target is held to the family its backend computes
(:meth:`Envelope.for_target`). Everything here is pure arithmetic on numbers: no torch, no
model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The statistics an envelope holds samples of, in order.
STATISTICS = ("noise_ratio", "token_noise_ratio", "contribution_bias")
#: A decode step's envelope also holds these: the noise ratio of the keys and of the values each
#: run appended to the layer's KV cache.
KV_STATISTICS = ("new_keys_noise_ratio", "new_values_noise_ratio")
#: The smallest spread of the bias a limit assumes, in noise units: the golden's own rounding
#: error along one direction is one unit, so no legitimate spread is narrower.
MIN_BIAS_SD = 1.0
#: A ratio's limit is at most this many times the largest value the runs reached (envelopes
#: whose ratios are relative, since rule 6). The runs mix alternatives (each run lowers every op
#: of a kind one way or the other), and a log-normal fitted to a mixture stretches its spread
#: far past every run: a trained Gemma 3 270M's bfloat16 layer whose runs reached noise_ratio
#: 3.54 got a limit of 12.5, its correct ports read at most 1.96. The least that passes that
#: model's float32 torch-xla port, whose layer 11 reads 1.52 times its runs' largest, is 1.5.
REACHED_FACTOR = 2.0
#: Where a same-device control can run (:meth:`Envelope.limits`' ``control``), a ratio's limit
#: is at most this many times the runs' largest value... On the trained calibration models (three
#: correct ports each, bf16 and fp32) the least that passes them all is 1.52 without a control
#: (Gemma 3 270M's float32 torch-xla port, layer 11: the device errs past the simulation) and
#: 1.25 with one (Qwen2.5-Coder's eager-attention CPU port, a bf16 decode step of layer 1: a
#: kernel of its own, which its control does not run).
CONTROLLED_REACH = 1.5
#: ...or this many times the control's own value where that is larger (never past the
#: ``REACHED_FACTOR`` limit): a port may err somewhat more than the model's own layer on the
#: same device, with an order of sums of its own.
CONTROL_FACTOR = 1.5
#: The ratios a same-device control tightens (:meth:`Envelope.limits`).
CONTROLLED = ("noise_ratio", "token_noise_ratio")
#: The ``method`` of a float16 layer's second family (:attr:`Envelope.float32_sums`).
FLOAT32_SUMS = "mca, float16 matmuls summed in float32"


def _t_density(x: float, df: int) -> float:
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_c - (df + 1) / 2 * math.log1p(x * x / df))


def _t_upper_tail(x: float, df: int) -> float:
    """P(T > x) for x >= 0, by Simpson's rule on the density (accurate to ~1e-9 here)."""
    steps = 600
    h = x / steps
    total = _t_density(0.0, df) + _t_density(x, df)
    for i in range(1, steps):
        total += (4 if i % 2 else 2) * _t_density(i * h, df)
    return 0.5 - total * h / 3


@functools.lru_cache(maxsize=64)
def t_quantile(p: float, df: int) -> float:
    """The Student-t quantile at probability ``p`` (0.5 <= p < 1) with ``df`` degrees of freedom."""
    if not 0.5 <= p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df >= 1, got p={p}, df={df}")
    tail = 1 - p
    lo, hi = 0.0, 1.0
    while _t_upper_tail(hi, df) > tail:
        lo, hi = hi, hi * 2
        if hi > 1e7:
            return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        if _t_upper_tail(mid, df) > tail:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, sd


@dataclass(frozen=True)
class Envelope:
    """K legitimate runs' statistics of one layer (one value per run and statistic)."""

    noise_ratio: tuple[float, ...]
    token_noise_ratio: tuple[float, ...]
    contribution_bias: tuple[float, ...]
    golden_bias: float  # the golden's own bias along the contribution, in noise units
    method: str = "mca"  # how the runs were perturbed
    #: A decode step's runs: each run's noise ratio of the keys and of the values it appended
    #: to the cache (empty for a prompt's envelope, or one extracted before they were kept).
    new_keys_noise_ratio: tuple[float, ...] = ()
    new_values_noise_ratio: tuple[float, ...] = ()
    #: Per branch of the layer (``compare.floor.BRANCH_PREFIX``): each run's ``branch_bias``
    #: and the golden's own bias along that branch (empty where the golden holds no branch).
    branch_bias: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    golden_branch_bias: Mapping[str, float] = field(default_factory=dict)
    #: Tokens every run's statistics left out because the golden's experts there differ from
    #: its floor's (``compare.routing_agreement.golden_floor_flips``); None for an envelope made before
    #: they were (a target is then judged on every token, as its runs were).
    golden_flips: tuple[int, ...] | None = None
    #: A float16 layer's second family: its runs with every float16 matmul summed in float32
    #: (None where the golden holds none: another dtype, or extracted before there were two).
    float32_sums: Envelope | None = None
    #: Whether the runs' ratios weigh each element's error by its size
    #: (``compare.floor.element_sizes``): a target is measured as they were. False for an
    #: envelope made before (envelope rule 6).
    relative: bool = False

    @property
    def samples(self) -> int:
        return len(self.noise_ratio)

    def for_target(self, sixteen_bit_sums: bool) -> Envelope:
        """The family a target is held to: the float32-summing runs where the target's float16
        matmuls sum in float32 (``sixteen_bit_sums`` False) and the golden holds them, else
        these runs (which may sum in float16)."""
        return self.float32_sums if not sixteen_bit_sums and self.float32_sums is not None else self

    def as_metadata(self) -> dict[str, Any]:
        kv = {name: [float(v) for v in getattr(self, name)] for name in KV_STATISTICS if getattr(self, name)}
        branches = (
            {
                "branch_bias": {name: [float(v) for v in values] for name, values in self.branch_bias.items()},
                "golden_branch_bias": {name: float(v) for name, v in self.golden_branch_bias.items()},
            }
            if self.branch_bias
            else {}
        )
        flips = {"golden_flips": list(self.golden_flips)} if self.golden_flips is not None else {}
        family = {"float32_sums": self.float32_sums.as_metadata()} if self.float32_sums is not None else {}
        return {
            "method": self.method,
            **({"relative": True} if self.relative else {}),
            "samples": self.samples,
            "golden_bias": self.golden_bias,
            **{name: [float(v) for v in getattr(self, name)] for name in STATISTICS},
            **kv,
            **branches,
            **flips,
            **family,
        }

    @classmethod
    def from_metadata(cls, data: Mapping[str, Any] | None) -> Envelope | None:
        """The envelope a golden's metadata holds, or None (goldens extracted without one).
        Raises ValueError on a malformed one."""
        if not data:
            return None
        try:
            values = {name: tuple(float(v) for v in data[name]) for name in STATISTICS}
            golden_bias = float(data["golden_bias"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed noise envelope ({exc!r})") from exc
        if len({len(v) for v in values.values()}) != 1 or len(values["noise_ratio"]) < 2:
            raise ValueError("malformed noise envelope: needs at least 2 samples of each statistic")
        if any(not math.isfinite(v) for vs in values.values() for v in vs):
            raise ValueError("malformed noise envelope: non-finite samples")
        try:
            kv = {name: tuple(float(v) for v in data[name]) for name in KV_STATISTICS if name in data}
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed noise envelope ({exc!r})") from exc
        if any(len(v) != len(values["noise_ratio"]) or not all(map(math.isfinite, v)) for v in kv.values()):
            raise ValueError("malformed noise envelope: the appended keys' or values' samples do not match the runs")
        try:
            branch = {str(k): tuple(float(v) for v in vs) for k, vs in (data.get("branch_bias") or {}).items()}
            golden_branch = {str(k): float(v) for k, v in (data.get("golden_branch_bias") or {}).items()}
        except (AttributeError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed noise envelope: branch_bias ({exc!r})") from exc
        if set(branch) != set(golden_branch) or any(
            len(v) != len(values["noise_ratio"]) or not all(map(math.isfinite, v)) for v in branch.values()
        ):
            raise ValueError("malformed noise envelope: the branches' samples do not match the runs")
        flips = data.get("golden_flips")
        if flips is not None and (
            not isinstance(flips, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in flips)
        ):
            raise ValueError(f"malformed noise envelope: golden_flips {flips!r} is not a list of token indices")
        wide = data.get("float32_sums")
        if wide is not None and not isinstance(wide, Mapping):
            raise ValueError(f"malformed noise envelope: float32_sums {wide!r} is not an envelope")
        try:
            float32_sums = cls.from_metadata(wide) if wide else None
        except ValueError as exc:
            raise ValueError(f"{exc} (its float32_sums family)") from None
        relative = data.get("relative", False)
        if not isinstance(relative, bool):
            raise ValueError(f"malformed noise envelope: relative {relative!r} is not true or false")
        return cls(
            relative=relative,
            float32_sums=float32_sums,
            golden_flips=tuple(flips) if flips is not None else None,
            golden_bias=golden_bias,
            method=str(data.get("method", "mca")),
            **values,
            **kv,
            branch_bias=branch,
            golden_branch_bias=golden_branch,
        )

    def limits(
        self,
        false_alarm_rate: float,
        lean: Mapping[str, float] | None = None,
        control: Mapping[str, float] | None = None,
    ) -> EnvelopeLimits:
        """The prediction limits at ``false_alarm_rate`` per test; ``lean``: per branch, how
        much wider its range is on each side (a kernel's lean along a bug's move,
        ``compare.verdict.kernel_lean``). ``control``: None where no same-device control can
        run; else the ``noise_ratio`` and ``token_noise_ratio`` the model's own layer read on
        the target, of those measured (none yet: the tighter limits alone, see
        ``CONTROLLED_REACH``)."""
        lean = {name: lean[name] for name in self.branch_bias if name in lean} if lean else {}
        k = self.samples
        per_statistic = false_alarm_rate / (len(STATISTICS) + len(self.branch_bias))
        q_ratio = t_quantile(1 - per_statistic, k - 1)
        q_bias = t_quantile(1 - per_statistic / 2, k - 1)
        widen = math.sqrt(1 + 1 / k)

        controlled = dict(control) if control is not None and self.relative else None

        def ratio_limit(values: Sequence[float]) -> float:
            mean, sd = _mean_sd([math.log(max(v, 1e-300)) for v in values])
            limit = math.exp(min(mean + q_ratio * sd * widen, 700.0))  # no OverflowError on a degenerate sample
            return min(limit, REACHED_FACTOR * max(values)) if self.relative else limit

        def held(wide: float, values: Sequence[float], name: str) -> float:
            """A ratio's limit ``wide`` (without a control) as a port beside a control is held to it."""
            if controlled is None:
                return wide
            tight = min(wide, CONTROLLED_REACH * max(values))  # CONTROLLED_REACH < REACHED_FACTOR
            return max(tight, min(wide, CONTROL_FACTOR * controlled[name])) if name in controlled else tight

        def bias_range(values: Sequence[float], golden: float, more: float = 0.0) -> tuple[float, float]:
            mean, sd = _mean_sd(values)
            half = q_bias * max(sd, MIN_BIAS_SD) * widen + more
            centres = (0.0, mean, golden)
            return min(centres) - half, max(centres) + half

        bias_low, bias_high = bias_range(self.contribution_bias, self.golden_bias)
        wide_noise, wide_token = ratio_limit(self.noise_ratio), ratio_limit(self.token_noise_ratio)
        return EnvelopeLimits(
            max_noise_ratio=held(wide_noise, self.noise_ratio, "noise_ratio"),
            max_token_noise_ratio=held(wide_token, self.token_noise_ratio, "token_noise_ratio"),
            wide_noise_ratio=wide_noise,
            control=controlled,
            bias_low=bias_low,
            bias_high=bias_high,
            reached={name: max(abs(v) for v in getattr(self, name)) for name in STATISTICS},
            samples=k,
            quantile=q_bias,
            method=self.method,
            max_appended_noise_ratio={
                name.removeprefix("new_").removesuffix("_noise_ratio"): ratio_limit(getattr(self, name))
                for name in KV_STATISTICS
                if getattr(self, name)
            },
            branch_bias={
                name: bias_range(values, self.golden_branch_bias[name], lean.get(name, 0.0))
                for name, values in self.branch_bias.items()
            },
            lean=lean,
        )


@dataclass(frozen=True)
class EnvelopeLimits:
    """What a target of one layer is held to (from its :class:`Envelope`)."""

    max_noise_ratio: float
    max_token_noise_ratio: float
    bias_low: float
    bias_high: float
    reached: dict[str, float]  # the largest (absolute) value each statistic took in the legitimate runs
    samples: int
    quantile: float
    #: A decode step's: the noise-ratio limit of the keys and of the values it appends (by
    #: "keys"/"values"), from the runs' own; empty where the envelope holds none.
    max_appended_noise_ratio: dict[str, float] = field(default_factory=dict)
    #: Per branch of the layer: the range its ``branch_bias`` is held to (empty without branches).
    branch_bias: dict[str, tuple[float, float]] = field(default_factory=dict)
    method: str = "mca"  # the runs' (:attr:`Envelope.method`)
    #: Per branch whose range a kernel's lean widens: by how much on each side (noise units).
    lean: dict[str, float] = field(default_factory=dict)
    #: The noise-ratio limit without a control's tightening, which the keys and values a decode
    #: step appends are widened to (``compare.judge.judge_appended_kv``); None: ``max_noise_ratio``.
    wide_noise_ratio: float | None = None
    #: None where no same-device control could run; else the control's values the ratios' limits
    #: were drawn with (empty: none ran, the limits are ``CONTROLLED_REACH`` times the runs').
    control: dict[str, float] | None = None

    def describe(self) -> str:
        branches = "".join(
            f", branch_bias_{n} in [{lo:.3g}, {hi:.3g}]"
            + (f" (a kernel's lean {self.lean[n]:.3g} each side)" if n in self.lean else "")
            for n, (lo, hi) in self.branch_bias.items()
        )
        how = " (float16 matmuls summed in float32, as the target does)" if self.method == FLOAT32_SUMS else ""
        return (
            f"noise envelope from {self.samples} perturbed runs of this layer{how}: they reach noise_ratio "
            f"{self.reached['noise_ratio']:.3g}, token_noise_ratio {self.reached['token_noise_ratio']:.3g}, "
            f"|contribution_bias| {self.reached['contribution_bias']:.3g}; limits at t={self.quantile:.2f}: "
            f"noise_ratio <= {self.max_noise_ratio:.3g}, token_noise_ratio <= {self.max_token_noise_ratio:.3g}, "
            f"contribution_bias in [{self.bias_low:.3g}, {self.bias_high:.3g}]{branches}{self._controlled()}"
        )

    def _controlled(self) -> str:
        """How a same-device control drew the ratios' limits (empty where none could run)."""
        if self.control is None:
            return ""
        ratios = f"the ratios' limits at most {CONTROLLED_REACH:g} times the runs' largest"
        if not self.control:
            return f"; {ratios} (a port under test, which a same-device control can be held beside)"
        read = ", ".join(f"{name} {value:.3g}" for name, value in self.control.items())
        return (
            f"; {ratios}, or {CONTROL_FACTOR:g} times what the model's own layer reads on this device "
            f"({read}) where that is more"
        )
