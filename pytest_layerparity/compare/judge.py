"""The judge: a pure function of tensors and settings that says whether a target's output
holds against its golden, and why.

Nothing here loads a model, a store or a device: :func:`judge` takes the golden output, the
target output and (when the golden has them) the precision floor, the layer's input and the
routers' decisions, and returns a :class:`LayerOutcome` with every metric, every check and
the minimum passing tolerance. The plugin, ``python -m pytest_layerparity compare`` and your
own scripts call the same function.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from .envelope import Envelope, EnvelopeLimits
from .floor import (
    FLOOR_KEY,
    HEADS_KEY,
    STEP_PREFIX,
    FloorStats,
    branch_directions,
    branch_moves,
    cause_directions,
    floor_stats,
    sight_directions,
    token_mask,
)
from .metrics import Metrics, compare_tensors, min_passing_tolerance
from .picture import FailurePicture, failure_picture
from .routing_agreement import RoutingAgreement, agreement, golden_floor_flips, router_names
from .shares import error_shares
from .sight import Sight, sight
from .sketch import head_shares
from .verdict import Check, evaluate, kernel_lean, policy_in_force

if TYPE_CHECKING:
    from ..options import Settings


@dataclass
class LayerOutcome:
    """The comparison of one layer's target output with its golden."""

    layer: int
    metrics: Metrics
    checks: list[Check]
    shape: tuple[int, ...]
    golden_dtype: str
    target_dtype: str
    floor: FloorStats | None = None
    routing: list[RoutingAgreement] = field(default_factory=list)
    excluded_tokens: list[int] = field(default_factory=list)
    tolerance: dict[str, float] = field(default_factory=dict)
    envelope: EnvelopeLimits | None = None  # the limits the noise policy drew from the golden's envelope
    tainted_tokens: list[int] = field(default_factory=list)  # left out after an earlier near-tie flip (chains)
    judged_tokens: int | None = None  # tokens the verdict's statistics kept (None: all of them)
    golden_flip_tokens: list[int] = field(default_factory=list)  # the golden's experts differ from its floor's
    prompt_kv: str | None = None  # a prompt test's: whether the keys and values it wrote were judged, or why not
    picture: FailurePicture | None = None  # a failing outcome's error against the golden's rounding
    #: a failing outcome's: the share of its error each stored direction explains (compare.diagnosis)
    error_shares: dict[str, float] = field(default_factory=dict)
    #: the share of the error of the keys and values the call wrote along themselves (a scale
    #: error of the attention's input reads near 1): "keys", "values"
    kv_self_shares: dict[str, float] = field(default_factory=dict)
    #: the test's detection limits: the smallest error of each stored kind it fails on (compare.sight)
    sight: Sight | None = None
    #: the same-device control's outcome (the model's own layer on the same call), where it ran
    #: to draw this outcome's limits (``replay.runner.TargetSide.judge_port``)
    control: LayerOutcome | None = None

    @property
    def passed(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def judged_nothing(self) -> bool:
        """Every token was left out of the verdict (each routed apart from the golden on a
        near tie, or followed such a flip in a chain): its checks held nothing."""
        return self.judged_tokens == 0

    def unjudged_reason(self, what: str) -> str:
        """Why nothing of ``what`` (e.g. "layer 3, decode step 0") was judged."""
        routers = sorted({r.router for r in self.routing if r.near_tie_tokens})
        why = (
            f"routed to other experts than the golden's on a near tie ({', '.join(routers)})"
            if routers
            else "followed a near-tie routing flip in an earlier layer of the chain"
        )
        rows = math.prod(self.shape[:-1]) if len(self.shape) > 1 else 1
        return (
            f"{what}: not judged: every one of its {rows} token(s) {why}, which the verdict leaves out as "
            "legitimate; --near-ties strict judges them"
        )


def tensor_dtype_text(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def tie_tolerance(settings: Settings, dtype: str) -> float:
    """Router margins (relative to the largest logit) below this count as near ties, for
    goldens without the exact router scores: a few units of the golden dtype's rounding."""
    return settings.router_tie_tolerance * float(torch.finfo(getattr(torch, dtype)).eps)


def judge(
    layer: int,
    golden: torch.Tensor,
    target: torch.Tensor,
    settings: Settings,
    dtype: str,
    *,
    floor: torch.Tensor | None = None,
    hidden_in: torch.Tensor | None = None,
    routing: Sequence[RoutingAgreement] = (),
    envelope: Envelope | None = None,
    tainted: Sequence[int] = (),
    branches: Mapping[str, torch.Tensor] | None = None,
    moves: Mapping[str, float] | None = None,
    golden_flips: Sequence[int] = (),
    steps: Mapping[str, float] | None = None,
    sights: Mapping[str, torch.Tensor] | None = None,
    causes: Mapping[str, torch.Tensor] | None = None,
    heads: torch.Tensor | None = None,
    control: Mapping[str, float] | None = None,
) -> LayerOutcome:
    """Hold ``target`` against ``golden`` (and against the precision floor ``floor``,
    the layer's input ``hidden_in``, the routers' agreement and the layer's noise envelope,
    when given). ``tainted``: tokens a chain already let diverge on a near-tie routing flip
    in an earlier layer, left out of the statistics against the floor. ``branches``: the
    outputs of the layer's branches in the floor's pass (by name), whose directions the
    target's error is measured along too, and ``moves`` the sizes of those whose move the
    golden stores (``compare.floor.branch_moves``). ``golden_flips``: tokens whose experts
    the golden chose otherwise than its floor, left out of the statistics against the floor
    (with ``--near-ties strict`` too: there the floor is no measure of the golden's
    rounding). ``sights`` and ``steps``: the moves the golden stores for the detection limits
    alone and the moves per unit of their change, which the test's detection limits are
    stated in (:mod:`.sight`). ``causes``: the moves the golden stores for the diagnosis
    alone, which a failure's error is measured along beside the branches', and ``heads`` each
    attention head's sketched part of the output (``compare.sketch``). ``control``: where a
    same-device control can be held beside the target, the ratios the model's own layer read
    there (of those measured; see ``Envelope.limits``)."""
    target_cpu = target.detach().to("cpu")
    if tuple(golden.shape) != tuple(target_cpu.shape):
        raise AssertionError(
            f"layer {layer}: the target's output has shape {tuple(target_cpu.shape)}, the golden "
            f"{tuple(golden.shape)}; the port returns something else than the reference layer"
        )
    routing = list(routing)
    near_ties = sorted({t for r in routing for t in r.near_tie_tokens})
    rows = golden.numel() // golden.shape[-1] if golden.dim() > 1 else 1
    strict = settings.near_ties == "strict"
    keep = None  # the verdict leaves near-tie routing flips out unless --near-ties strict
    tainted = sorted({t for t in tainted if 0 <= t < rows}) if not strict else []
    flips = sorted({t for t in golden_flips if 0 <= t < rows}) if golden.dim() > 1 else []
    if golden.dim() > 1:
        keep = token_mask(rows, [*(near_ties if not strict else []), *tainted, *flips])
    excluded = near_ties if settings.near_ties == "exclude" and keep is not None else []
    g_cmp, t_cmp = golden, target_cpu
    compared = token_mask(rows, [*excluded, *tainted]) if keep is not None else None
    if compared is not None:  # tainted tokens leave the output metrics too
        g_cmp = golden.reshape(-1, golden.shape[-1])[compared]
        t_cmp = target_cpu.reshape(-1, golden.shape[-1])[compared]
    metrics = compare_tensors(g_cmp, t_cmp)
    verdict_cosine = None  # the noise policy's cosine leaves near-tie tokens out as its ratios do
    if keep is not None and compared is None:
        rows_g, rows_t = golden.reshape(-1, golden.shape[-1]), target_cpu.reshape(-1, golden.shape[-1])
        verdict_cosine = compare_tensors(rows_g[keep], rows_t[keep]).cosine_similarity
    stats = None
    relative = envelope is not None and envelope.relative  # measured as the envelope's runs were
    if floor is not None and tuple(floor.shape) == tuple(golden.shape):
        stats = floor_stats(golden, target_cpu, floor, hidden_in, keep, branches, moves, relative)
    limits = None
    if envelope is not None and stats is not None:
        limits = envelope.limits(settings.false_alarm_rate, kernel_lean(stats, dtype), control)
    checks = evaluate(metrics, settings, floor=stats, dtype=dtype, envelope=limits, cosine=verdict_cosine)
    seen = None
    if stats is not None and floor is not None and policy_in_force(settings, True) == "noise":
        passed = all(check.ok for check in checks)  # else: what a port as exact as the reference shows
        base, base_stats = (target_cpu, stats) if passed else (golden, None)
        if base_stats is None:
            base_stats = floor_stats(golden, golden, floor, hidden_in, keep, branches, moves, relative)
        seen = sight(
            golden,
            base,
            floor,
            base_stats,
            metrics if passed else replace(metrics, target_nan=metrics.golden_nan, target_inf=metrics.golden_inf),
            settings,
            dtype,
            limits,
            hidden_in=hidden_in,
            keep=keep,
            branches=branches,
            steps=steps,
            moves=moves,
            sights=sights,
            relative=relative,
            base_name="port" if passed else "reference",
        )
    picture, shares = None, {}
    if not all(check.ok for check in checks):
        if stats is not None and floor is not None:
            picture = failure_picture(golden, target_cpu, floor, keep)
        shares = error_shares(golden, target_cpu, {**(branches or {}), **(causes or {})}, keep)
        shares.update(head_shares(golden, target_cpu, heads, keep))
    return LayerOutcome(
        layer=layer,
        metrics=metrics,
        checks=checks,
        shape=tuple(golden.shape),
        golden_dtype=tensor_dtype_text(golden),
        target_dtype=tensor_dtype_text(target_cpu),
        floor=stats,
        routing=routing,
        excluded_tokens=excluded,
        tolerance=min_passing_tolerance(g_cmp, t_cmp),
        envelope=limits,
        tainted_tokens=tainted,
        judged_tokens=int(keep.sum()) if keep is not None else None,
        golden_flip_tokens=flips,
        picture=picture,
        error_shares=shares,
        sight=seen,
    )


def paired_routers(golden: list[str], target_routing: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """The target's routing under the golden's router names. A port may name its router
    otherwise (NxDI's ``mlp.router`` for transformers' ``mlp.gate``): where the golden and the
    target each recorded exactly one router and the names differ, the target's is renamed."""
    target = router_names(dict(target_routing))
    if len(golden) != 1 or len(target) != 1 or golden == target:
        return target_routing
    old, new = f"routing.{target[0]}.", f"routing.{golden[0]}."
    return {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in target_routing.items()}


def routing_agreements(
    golden_tensors: Mapping[str, torch.Tensor],
    target_routing: Mapping[str, torch.Tensor],
    settings: Settings,
    dtype: str,
) -> list[RoutingAgreement]:
    """The agreement of every router the golden recorded and the target ran."""
    tolerance = tie_tolerance(settings, dtype)
    names = router_names(dict(golden_tensors))
    target_routing = paired_routers(names, target_routing)
    found = (agreement(name, dict(golden_tensors), dict(target_routing), tolerance) for name in names)
    return [r for r in found if r is not None]


def judge_golden(
    layer: int,
    golden_tensors: Mapping[str, torch.Tensor],
    output_name: str,
    target: torch.Tensor,
    target_routing: Mapping[str, torch.Tensor],
    settings: Settings,
    dtype: str,
    *,
    hidden_in: torch.Tensor | None = None,
    envelope: Envelope | None = None,
    tainted: Sequence[int] = (),
    control: Mapping[str, float] | None = None,
) -> LayerOutcome:
    """:func:`judge` on a golden's tensors: its output ``output_name``, its precision floor
    and recorded routing when it has them; ``hidden_in`` is the layer's input (the golden's
    own unless a chain gives another); ``envelope`` the golden's noise envelope (or a
    chain's); ``control`` as :func:`judge` takes it."""
    return judge(
        layer,
        golden_tensors[output_name],
        target,
        settings,
        dtype,
        floor=golden_tensors.get(FLOOR_KEY),
        hidden_in=hidden_in,
        routing=routing_agreements(golden_tensors, target_routing, settings, dtype),
        envelope=envelope,
        tainted=tainted,
        branches=branch_directions(golden_tensors),
        moves=branch_moves(golden_tensors),
        steps=branch_moves(golden_tensors, STEP_PREFIX),
        sights=sight_directions(golden_tensors),
        causes=cause_directions(golden_tensors),
        heads=golden_tensors.get(HEADS_KEY),
        control=control,
        # as the envelope's runs were judged: an envelope made before the rule has none
        golden_flips=golden_floor_flips(dict(golden_tensors))
        if envelope is None or envelope.golden_flips is not None
        else (),
    )


def judge_appended_kv(
    golden_tensors: Mapping[str, torch.Tensor],
    appended: tuple[torch.Tensor, torch.Tensor] | None,
    settings: Settings,
    dtype: str,
    envelope: EnvelopeLimits | None = None,
    states: bool = False,
    prefix: str = "new_",
) -> list[Check]:
    """The checks of the keys and values a decode step appended to the layer's KV cache,
    against the golden's (``cache.new_keys``/``new_values``): cosine similarity and, where the
    golden holds their precision floor (``floor.cache.*``), the noise ratio, with the limits of
    the dtype's fixed policy, widened to the step's own noise-ratio limit where its envelope
    (``envelope``, the output's) allows more, and to the limit of the appended keys' (values')
    own noise ratios in the perturbed runs where the envelope holds them: one token's keys are
    few numbers (fewer still with few KV heads), whose noise ratio spreads more widely than the
    output's. With ``states``, the golden's update is a linear-attention layer's convolution
    and recurrent states as the step left them (``new_conv_states_*``,
    ``new_recurrent_states_*``): many numbers, held to the dtype's fixed limit or their own runs'
    limit, not widened to the output's. No checks when the golden recorded no cache update.
    ``prefix``: the checks' names' (``prompt_`` for the keys and values a prompt wrote to an
    empty cache: ``prompt_keys_cosine``, ...)."""
    from .verdict import noise_limits

    if "cache.new_keys" not in golden_tensors:
        return []
    if appended is None:
        return [Check("kv_cache_appended" if prefix == "new_" else f"{prefix}kv_written", 0, "==", 1, False)]
    fixed, _, min_cosine = noise_limits(settings, dtype)
    if envelope is not None and not states:  # the output's limit without a control's tightening
        fixed = max(fixed, envelope.max_noise_ratio if envelope.wide_noise_ratio is None else envelope.wide_noise_ratio)
    checks = []
    labels = ("conv_states", "recurrent_states") if states else ("keys", "values")
    for part, label, target in zip(("keys", "values"), labels, appended, strict=True):
        # the appended keys' (values') own envelope where the runs kept theirs: a few numbers
        # (one token's, of few KV heads) whose ratio spreads more than the output's
        max_ratio = max(fixed, envelope.max_appended_noise_ratio.get(part, 0.0)) if envelope is not None else fixed
        golden = golden_tensors[f"cache.new_{part}"]
        if tuple(target.shape) != tuple(golden.shape):
            checks.append(Check(f"{prefix}{label}_positions", target.shape[-2], "==", golden.shape[-2], False))
            continue
        floor = golden_tensors.get(f"floor.cache.new_{part}")
        m = compare_tensors(golden, target, floor=floor)
        cosine = m.cosine_similarity
        checks.append(
            Check(f"{prefix}{label}_cosine", cosine, ">=", min_cosine, not math.isnan(cosine) and cosine >= min_cosine)
        )
        if floor is not None and m.noise_ratio is not None:
            ratio = m.noise_ratio
            checks.append(
                Check(
                    f"{prefix}{label}_noise_ratio", ratio, "<=", max_ratio, not math.isnan(ratio) and ratio <= max_ratio
                )
            )
    return checks
