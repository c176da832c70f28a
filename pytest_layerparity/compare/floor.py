"""Statistics against the precision floor: how far the target is from a higher-precision
evaluation of the same layer (the floor, stored in the golden as ``floor.output``), measured
in units of the golden's own rounding error (its noise).

``noise_ratio = ||target - ref|| / ||golden - ref||`` where ``ref`` is the layer evaluated in
float32 (float64 for float32 goldens). A correct port makes about the same rounding error as
the reference (ratio near 1); a bug adds an error of its own. Per token (rows of the last
dimension) the same ratio, with the golden error floored at its median so that a token the
golden happened to round well does not make a ratio from nothing, shows bugs that touch only
some tokens and that a tensor-wide norm averages away.

Relative (``relative``, every envelope made since rule 6): each element's error is weighed by
its size first, ``(x - ref) / max(|ref|, the token's median |ref|)``. A trained model's few
massive-activation channels, thousands of times the others, otherwise make the norms one or two
elements' rounding, which legitimate runs draw anew: their noise_ratio then spread 0.5-10 on one
decode step, and the limits with them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .chunks import STATISTICS_DEVICES

#: A golden stores the precision floor of its tensor ``X`` (the layer evaluated in higher
#: precision) as ``floor.X``: the output, the routers' scores, a decode step's appended keys
#: and values. Stores of schema 1 named them ``ref_X`` (read as ``floor.X``).
FLOOR_PREFIX = "floor."
#: The floor of the layer's output.
FLOOR_KEY = FLOOR_PREFIX + "output"
#: The output of each of the layer's branches (``floor.branch.<child>``: a child module whose
#: output is a part of the layer's contribution, such as its attention and its MLP:
#: ``noise.wide_pass.contribution_branches``) in the floor's pass, stored in the golden's
#: dtype: the directions ``branch_bias`` measures the target's error along.
BRANCH_PREFIX = FLOOR_PREFIX + "branch."
#: Where a direction's move is itself a bug's whole effect (GELU's other form: the swap), its
#: size as a multiple of the stored direction's norm (``floor.move.<name>``, one number): what
#: a port with that bug reads along it (:attr:`FloorStats.branch_move`).
MOVE_PREFIX = FLOOR_PREFIX + "move."
#: Where a direction is the move of a change with a measure of its own (the attention
#: scores' scale), the move per unit of that measure as a multiple of the stored direction
#: (``floor.step.<name>``, one number): what ``compare.sight`` states a test's detection
#: limits in.
STEP_PREFIX = FLOOR_PREFIX + "step."
#: The moves a test's detection limits are stated along and that no check of the verdict
#: measures (``floor.sight.<kind>``: the attention's output scaled, the norms' epsilon as a
#: factor), each scaled to the output's norm with its move per unit under ``STEP_PREFIX``.
SIGHT_PREFIX = FLOOR_PREFIX + "sight."
#: The moves a golden holds for the diagnosis alone (``floor.cause.<kind>``: each norm's
#: weight, the norms' biases), scaled to the output's norm: what a failing test's error is
#: held against to name its cause (``compare.diagnosis``), no check's direction.
CAUSE_PREFIX = FLOOR_PREFIX + "cause."
#: Each attention head's own part of the output, sketched (``floor.heads``: one row per head,
#: ``compare.sketch``), for the diagnosis alone.
HEADS_KEY = FLOOR_PREFIX + "heads"


def branch_directions(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The branch outputs a golden holds, by branch name (in the names' order: a failure's table
    and JUnit list them the same way in every run)."""
    return {k[len(BRANCH_PREFIX) :]: v for k, v in sorted(tensors.items()) if k.startswith(BRANCH_PREFIX)}


def sight_directions(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The moves a golden holds for the detection limits alone (``SIGHT_PREFIX``), by kind."""
    return {k[len(SIGHT_PREFIX) :]: v for k, v in tensors.items() if k.startswith(SIGHT_PREFIX)}


def cause_directions(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The moves a golden holds for the diagnosis alone (``CAUSE_PREFIX``), by kind."""
    return {k[len(CAUSE_PREFIX) :]: v for k, v in tensors.items() if k.startswith(CAUSE_PREFIX)}


def branch_moves(tensors: Mapping[str, torch.Tensor], prefix: str = MOVE_PREFIX) -> dict[str, float]:
    """The moves' sizes a golden holds (``MOVE_PREFIX``; with ``STEP_PREFIX`` the moves per
    unit of their change), by direction name."""
    return {k[len(prefix) :]: float(v) for k, v in tensors.items() if k.startswith(prefix)}


@dataclass(frozen=True)
class FloorStats:
    noise_ratio: float
    token_noise_ratio: float  # the largest per-token ratio
    worst_token: int
    golden_error: float  # ||golden - ref|| (the floor)
    target_error: float  # ||target - ref||
    delta_cosine: float | None  # cosine of (target - input) and (golden - input): the layer's own contribution
    tokens: int
    contribution_z: float | None = None  # (target - golden) along the layer's contribution, in noise units
    golden_contribution_z: float | None = None  # (golden - ref) along it: the golden's own bias
    #: per branch (``BRANCH_PREFIX``): (target - golden) along the branch's output, in noise
    #: units, and (golden - ref) along it
    branch_z: dict[str, float] = field(default_factory=dict)
    golden_branch_z: dict[str, float] = field(default_factory=dict)
    #: per direction whose move the golden stores (``MOVE_PREFIX``): that move along the
    #: direction, in noise units (what a port with the bug reads beyond the floor)
    branch_move: dict[str, float] = field(default_factory=dict)
    #: whether the two ratios weigh each element's error by its size (:func:`element_sizes`)
    relative: bool = False

    @property
    def contribution_bias(self) -> float | None:
        """The target's error along the layer's contribution relative to the floor (not the
        golden), in noise units: 0 for a target that computes exactly, ``golden_contribution_z``
        for one that rounds as the golden did."""
        if self.contribution_z is None or self.golden_contribution_z is None:
            return None
        return self.contribution_z + self.golden_contribution_z

    @property
    def branch_bias(self) -> dict[str, float]:
        """Per branch, the target's error along the branch's output relative to the floor, in
        noise units (as ``contribution_bias`` is along the whole layer's contribution): a bug
        inside one branch (an attention scaled, an expert's projection off) moves the output
        along that branch's own output, which the layer's whole contribution dilutes."""
        return {name: z + self.golden_branch_z[name] for name, z in self.branch_z.items()}

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def token_mask(rows: int, left_out: Iterable[int]) -> torch.Tensor | None:
    """A boolean mask over ``rows`` tokens that leaves ``left_out`` out, or None when none is."""
    drop = sorted(set(left_out))
    if not drop:
        return None
    keep = torch.ones(rows, dtype=torch.bool)
    keep[drop] = False
    return keep


#: Elements of one block of tokens the statistics are computed on (float64: 2 MB a tensor,
#: about ten at once). Whole, a layer's output at seq 2048 and hidden 1024 is 17 MB in
#: float64, and the statistics held ten such tensors: more than the layer's activations.
BLOCK_ELEMENTS = 1 << 18


def row_blocks(rows: torch.Tensor, elements: int) -> list[slice]:
    """Blocks of the rows of ``rows`` [n, width], each at most ``elements`` elements (at least
    one row): what a statistic takes at a time."""
    step = max(1, elements // max(1, rows.shape[-1]))
    return [slice(start, start + step) for start in range(0, rows.shape[0], step)]


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    return x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)


@dataclass
class _Sums:
    """What the statistics need, summed over blocks of tokens (float64)."""

    err_g: list[torch.Tensor]  # per token ||golden - ref|| (weighed where relative: :func:`element_sizes`)
    err_t: list[torch.Tensor]  # per token ||target - ref|| (weighed alike)
    relative: bool = False
    # the norms as they are, where err_g and err_t are weighed
    raw_g: list[torch.Tensor] = field(default_factory=list)
    raw_t: list[torch.Tensor] = field(default_factory=list)
    ref_sq: float = 0.0
    unit_sq: float = 0.0  # ||ref||^2 in err_g's units
    dg_dt: float = 0.0  # (golden - input) . (target - input)
    dg_sq: float = 0.0
    dt_sq: float = 0.0
    u_sq: float = 0.0  # ||ref - input||^2: the layer's own contribution
    tg_u: float = 0.0  # (target - golden) . (ref - input)
    gr_u: float = 0.0  # (golden - ref) . (ref - input)
    # per branch: [||v||^2, (target - golden) . v, (golden - ref) . v] with v the branch's output
    branches: dict[str, list[float]] = field(default_factory=dict)

    def add(
        self,
        g: torch.Tensor,
        t: torch.Tensor,
        r: torch.Tensor,
        x: torch.Tensor | None,
        branches: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """One block's sums, each written into one tensor and read back from its device at
        once (one wait, not one a sum; on the CPU no small tensor outlives its sum, which would
        make the next block's temporaries fresh pages)."""
        eg, et = g - r, t - r
        if self.relative:
            self.raw_g.append(eg.norm(dim=-1))
            self.raw_t.append(et.norm(dim=-1))
            size = element_sizes(r)
            eg, et = eg / size, et / size
            self.unit_sq += float((r / size).square().sum())
        self.err_g.append(eg.norm(dim=-1))
        self.err_t.append(et.norm(dim=-1))
        found = torch.empty(1 + 3 * len(branches or {}) + 6 * (x is not None), dtype=g.dtype, device=g.device)
        into = iter(found)

        def dot(a: torch.Tensor, b: torch.Tensor) -> None:
            torch.sum(a * b, dim=None, out=next(into))

        dot(r, r)
        for v in (branches or {}).values():
            dot(v, v)
            dot(t - g, v)
            dot(g - r, v)
        if x is not None:
            dg, dt, u = g - x, t - x, r - x
            for a, b in ((dg, dt), (dg, dg), (dt, dt), (u, u)):
                dot(a, b)
            dot(t - g, u)
            dot(g - r, u)
        values = found.tolist()
        self.ref_sq += values[0]
        for i, name in enumerate(branches or {}):
            sums = self.branches.setdefault(name, [0.0, 0.0, 0.0])
            for j in range(3):
                sums[j] += values[1 + 3 * i + j]
        if x is not None:
            dg_dt, dg_sq, dt_sq, u_sq, tg_u, gr_u = values[-6:]
            self.dg_dt += dg_dt
            self.dg_sq += dg_sq
            self.dt_sq += dt_sq
            self.u_sq += u_sq
            self.tg_u += tg_u
            self.gr_u += gr_u


def element_sizes(ref: torch.Tensor) -> torch.Tensor:
    """What each element's error is weighed by in relative statistics: the size of the floor
    there, at least its token's median size (an element near zero is rounded as its token's
    other terms were, not to its own tiny size), never zero (rows [tokens, width])."""
    size = ref.abs()
    return torch.maximum(size, size.median(dim=-1, keepdim=True).values).clamp_min(torch.finfo(ref.dtype).tiny)


def statistics_device(*devices: torch.device | str) -> torch.device:
    """Where the float64 statistics of tensors on ``devices`` are computed: the first of them
    that is an accelerator of ``chunks.STATISTICS_DEVICES`` (a GPU's float64 sums are fast,
    and its tensors need not cross to the host: on an H200 the host's sums were half of an
    envelope's time), else the CPU."""
    for device in map(torch.device, devices):
        if device.type != "cpu" and device.type in STATISTICS_DEVICES:
            return device
    return torch.device("cpu")


def _sums(
    golden: torch.Tensor,
    target: torch.Tensor,
    reference: torch.Tensor,
    hidden_in: torch.Tensor | None,
    keep_tokens: torch.Tensor | None,
    directions: Mapping[str, torch.Tensor] | None = None,
    relative: bool = False,
) -> tuple[_Sums, int, int]:
    """The sums over the kept tokens, a block of tokens at a time in float64 (never a
    float64 copy of the whole tensors) on :func:`statistics_device`; with the number of
    tokens and of elements kept. ``relative``: the errors' norms weighed element by element
    (:func:`element_sizes`)."""
    g, t, r = _rows(golden), _rows(target), _rows(reference)
    x = _rows(hidden_in) if hidden_in is not None and hidden_in.shape == golden.shape else None
    v = {name: _rows(d) for name, d in (directions or {}).items() if d.shape == golden.shape}
    device = statistics_device(*(a.device for a in (g, t, r, x) if a is not None))
    if keep_tokens is not None:
        keep_tokens = keep_tokens.to(device)
    sums = _Sums([], [], relative)
    kept = 0
    for block in row_blocks(g, BLOCK_ELEMENTS):
        rows = keep_tokens[block] if keep_tokens is not None else None
        wide = [None if a is None else _wide(a[block], device, rows) for a in (g, t, r, x)]
        kept += wide[0].shape[0]
        sums.add(*wide, {name: _wide(d[block], device, rows) for name, d in v.items()})
    return sums, kept, kept * g.shape[-1]


def _wide(rows: torch.Tensor, device: torch.device, keep: torch.Tensor | None) -> torch.Tensor:
    """A block of rows in float64 on ``device``, only the ``keep`` ones where given."""
    rows = rows.to(device, torch.float64)
    return rows if keep is None else rows[keep]


def token_floor(err_g: torch.Tensor, ref_sq: float) -> tuple[torch.Tensor, float]:
    """The per-token noise each token's error is measured in (the golden's own error per token,
    floored at its median so that a token the golden happened to round well does not make a
    ratio from nothing), and the least error counted (``ref_sq``: the floor's squared norm)."""
    tiny = 1e-12 * ref_sq**0.5 + 1e-300
    return torch.maximum(err_g, err_g.median()).clamp_min(tiny), tiny


def floor_stats(
    golden: torch.Tensor,
    target: torch.Tensor,
    reference: torch.Tensor,
    hidden_in: torch.Tensor | None = None,
    keep_tokens: torch.Tensor | None = None,
    directions: Mapping[str, torch.Tensor] | None = None,
    moves: Mapping[str, float] | None = None,
    relative: bool = False,
) -> FloorStats:
    """The statistics against the floor ``reference``, over tokens (optionally only the
    ``keep_tokens`` boolean mask); ``directions``: the branches' outputs (by name) whose
    ``branch_bias`` is measured too; ``moves``: the sizes of those whose move the golden
    stores (:func:`branch_moves`); ``relative``: ``noise_ratio`` and ``token_noise_ratio``
    on errors weighed element by element (:func:`element_sizes`; the rest is unweighed)."""
    sums, tokens, elements = _sums(golden, target, reference, hidden_in, keep_tokens, directions, relative)
    if tokens == 0:
        return FloorStats(0.0, 0.0, -1, 0.0, 0.0, None, 0)
    err_g, err_t = torch.cat(sums.err_g), torch.cat(sums.err_t)
    floor, tiny = token_floor(err_g, sums.unit_sq if relative else sums.ref_sq)
    ratio = float(err_t.norm()) / (float(err_g.norm()) + tiny)
    per_token = err_t / floor
    if relative:
        err_g, err_t = torch.cat(sums.raw_g), torch.cat(sums.raw_t)
    golden_error = float(err_g.norm())
    target_error = float(err_t.norm())
    worst = int(per_token.argmax())
    delta_cos = z_t = z_g = None
    has_input = hidden_in is not None and hidden_in.shape == golden.shape
    if has_input:
        denom = (sums.dg_sq * sums.dt_sq) ** 0.5
        delta_cos = max(-1.0, min(1.0, sums.dg_dt / denom)) if denom > 0 else 1.0
        # A bug that scales or skews the layer's own contribution (output - input) leaves a
        # consistent component along it. The golden's rounding may have one too (16-bit
        # rounding of a large contribution is biased), so the target is measured against the
        # golden along that direction, in units of the golden's noise per element.
        unorm = sums.u_sq**0.5
        if unorm > 0 and golden_error > 0:
            scale = (elements**0.5) / golden_error
            z_t = sums.tg_u / unorm * scale
            z_g = sums.gr_u / unorm * scale
    branch_z, golden_branch_z, branch_move = {}, {}, {}
    if golden_error > 0:  # the same along each branch's output
        scale = (elements**0.5) / golden_error
        for name, (v_sq, tg_v, gr_v) in sums.branches.items():
            if v_sq > 0:
                branch_z[name] = tg_v / v_sq**0.5 * scale
                golden_branch_z[name] = gr_v / v_sq**0.5 * scale
                if moves and name in moves:
                    branch_move[name] = moves[name] * v_sq**0.5 * scale
    return FloorStats(
        ratio,
        float(per_token[worst]),
        worst,
        golden_error,
        target_error,
        delta_cos,
        tokens,
        z_t,
        z_g,
        branch_z,
        golden_branch_z,
        branch_move,
        relative,
    )
