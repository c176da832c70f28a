"""Exact, memory-bounded comparison metrics between a golden tensor and a target tensor.

Everything is computed in float64 on the device that holds ``golden``, chunk by chunk, so
the extra memory is a handful of float64 chunk buffers whatever the size of the inputs
(12 MiB with the CPU default chunk; on the CPU that block is kept per thread for the next
call), and every statistic agrees with a plain float64
computation (``golden.double()``, ``target.double()`` and the textbook formulas) to within
a few units in the last place:

* every element is widened to float64 exactly (bf16, fp16, fp32 and integers up to 2**53
  are exact in float64), then the differences, products and comparisons are the very
  float64 operations a reference computation does;
* sums are float64 reductions per chunk (``torch.sum``/``torch.dot`` on float64), and the
  per-chunk partial sums are added with :func:`math.fsum`;
* the Pearson correlation is taken from the one-pass sums only when the data are well
  conditioned (means small next to the spread), otherwise a second, centred pass over the
  data computes it (the classic corrected two-pass algorithm); constant inputs are
  recognised exactly (min == max) rather than from a variance that rounding made tiny;
* cosine and Pearson are clamped to [-1, 1], so a tensor compared with itself gives 1.0
  and never 1.0000001.

Devices: the work runs on golden's device when that is the CPU or CUDA (a target or
reference elsewhere is brought over chunk by chunk); tensors on any other device (XLA,
MPS, ...) are copied to the CPU first, whole.

Non-finite values: NaN and Inf are counted per tensor; the statistics are computed over the
positions where both values are finite. A chunk is known to be all-finite when the float64
sums of both of its tensors are finite (any NaN or Inf makes a float64 sum non-finite), so
the NaN/Inf bookkeeping costs nothing on clean data: only the chunks whose sums are not
finite are revisited with masks.

Long because every metric here comes from the same chunked float64 passes (:class:`_Chunks`).
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch

__all__ = [
    "METRIC_NAMES",
    "Metrics",
    "compare_tensors",
    "min_passing_tolerance",
    "noise_ratio",
]

METRIC_NAMES: tuple[str, ...] = (
    "max_abs_diff",
    "mean_abs_diff",
    "similarity_percentage",
    "cosine_similarity",
    "pearson_correlation",
)

#: The ``tiny`` of ``max_rel_diff = max |t-g| / (|g| + tiny)``: the smallest normal float64.
#: For bf16/fp16/fp32/integer goldens ``|g| + tiny == |g|`` exactly whenever ``g != 0``.
REL_TINY: float = float(torch.finfo(torch.float64).tiny)

# Default chunk lengths (elements). CPU: five float64 buffers of 256 Ki elements (10 MiB)
# stay in the L3 cache while keeping the per-op overhead (~20 ops a chunk) small; measured
# best on 2 cores (128 Ki: ~5% slower, 512 Ki: ~10% slower, 64 Ki: ~30% slower).
_CPU_CHUNK = 1 << 18
# GPU: five float64 buffers of 1 Mi elements is 40 MiB, few kernel launches.
_GPU_CHUNK = 1 << 20

#: Devices whose tensors' float64 statistics are computed where they are (here chunk by
#: chunk, and ``floor.statistics_device``'s); any other device's go to the CPU (an XLA device
#: would compile a graph per chunk; MPS has no float64).
STATISTICS_DEVICES = ("cpu", "cuda")

# The one-pass Pearson formula is used only when its worst-case relative error is far
# below 1e-9; see _pearson_needs_two_pass.
_PEARSON_COND_LIMIT = 1e2


@dataclass(frozen=True)
class Metrics:
    """Result of :func:`compare_tensors`. All floats are Python floats."""

    max_abs_diff: float
    mean_abs_diff: float
    similarity_percentage: float
    cosine_similarity: float
    pearson_correlation: float
    numel: int
    golden_nan: int
    golden_inf: int
    target_nan: int
    target_inf: int
    worst_index: tuple[int, ...]
    worst_golden: float
    worst_target: float
    max_rel_diff: float
    noise_ratio: float | None = None

    def as_dict(self) -> dict[str, float | int | list | None]:
        """A JSON-serialisable dict (``worst_index`` as a list).

        Non-finite floats stay floats: ``json.dumps`` writes them as ``NaN``/``Infinity``.
        """
        d = asdict(self)
        d["worst_index"] = list(self.worst_index)
        return d

    @property
    def has_nan_or_inf(self) -> bool:
        return bool(self.golden_nan or self.golden_inf or self.target_nan or self.target_inf)


# --------------------------------------------------------------------------- helpers


def _as_tensor(x: Any, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    if x.is_complex():
        raise TypeError(f"{name}: complex tensors are not supported (dtype {x.dtype})")
    return x.detach()


def _check_shapes(golden: torch.Tensor, other: torch.Tensor, name: str) -> None:
    if tuple(golden.shape) != tuple(other.shape):
        raise ValueError(
            f"shape mismatch: golden has shape {tuple(golden.shape)}, {name} has shape {tuple(other.shape)}"
        )


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    idx = []
    for size in reversed(shape):
        idx.append(flat % size)
        flat //= size
    return tuple(reversed(idx))


# CPU chunk buffers are kept (one block per thread, up to _CACHED_BLOCK_MAX float64) and
# reused across calls: writing into freshly mapped memory page-faults, and on a 1M-element
# comparison that first touch of ~12 MiB cost more (~3 ms) than the arithmetic (~2 ms).
# CUDA needs no such cache: torch's caching allocator already reuses device memory.
_CACHED_BLOCK_MAX = 8 * _CPU_CHUNK
_local = threading.local()


def _take_block(device: torch.device, numel: int) -> torch.Tensor:
    if device.type == "cpu" and numel <= _CACHED_BLOCK_MAX:
        block = getattr(_local, "block", None)
        _local.block = None  # in use: a nested call would allocate its own
        if block is not None and block.numel() >= numel:
            return block
        return torch.empty(numel, dtype=torch.float64)
    return torch.empty(numel, dtype=torch.float64, device=device)


def _give_back_block(device: torch.device, block: torch.Tensor | None) -> None:
    if block is None or device.type != "cpu" or block.numel() > _CACHED_BLOCK_MAX:
        return
    current = getattr(_local, "block", None)
    if current is None or current.numel() < block.numel():
        _local.block = block


class _Chunks:
    """Flat views of the inputs and float64 chunk buffers on golden's device.

    golden and target of a chunk are widened into the two rows of one (2, chunk) buffer,
    so that both sums are one reduction; a floor goes to a buffer of its own.
    """

    def __init__(self, tensors: list[torch.Tensor], chunk_elements: int | None, nscratch: int):
        # Compute where golden lives when that is the CPU or a CUDA device. Other devices
        # (XLA and other lazy or float64-less backends) are brought to the CPU whole, once:
        # slicing them chunk by chunk would run (and on XLA compile) one graph per chunk.
        tensors = [t if t.device.type in STATISTICS_DEVICES else t.cpu() for t in tensors]
        self.device = tensors[0].device
        self.flat = [t.reshape(-1) for t in tensors]
        self.numel = self.flat[0].numel()
        if chunk_elements is None:
            chunk_elements = _CPU_CHUNK if self.device.type == "cpu" else _GPU_CHUNK
        chunk_elements = int(chunk_elements)
        if chunk_elements <= 0:
            raise ValueError(f"chunk_elements must be positive, got {chunk_elements}")
        self.chunk = max(1, min(chunk_elements, self.numel))
        self.nchunks = -(-self.numel // self.chunk) if self.numel else 0
        nrows = len(self.flat) + nscratch
        self._block = _take_block(self.device, nrows * self.chunk)
        rows = self._block[: nrows * self.chunk].view(nrows, self.chunk)
        self.pair = rows[:2]
        self.extra = list(rows[2 : len(self.flat)])
        self.scratch = list(rows[len(self.flat) :])

    def __enter__(self) -> _Chunks:
        return self

    def __exit__(self, *exc) -> None:
        _give_back_block(self.device, self._block)
        self._block = None

    def bounds(self, i: int) -> tuple[int, int]:
        s = i * self.chunk
        return s, min(self.numel, s + self.chunk)

    def load(self, i: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Chunk ``i`` in float64: the (2, m) golden/target pair and the other inputs."""
        s, e = self.bounds(i)
        pair = self.pair[:, : e - s]
        pair[0].copy_(self.flat[0][s:e])
        pair[1].copy_(self.flat[1][s:e])
        rest = []
        for f, buf in zip(self.flat[2:], self.extra, strict=False):
            v = buf[: e - s]
            v.copy_(f[s:e])
            rest.append(v)
        return pair, rest

    def scratch_for(self, m: int) -> list[torch.Tensor]:
        return [b[:m] for b in self.scratch]


class _ChunkStats(NamedTuple):
    """One chunk's float64 sums and maxima over its all-finite pairs, on the host: what
    :func:`_chunk_stats` computes, in this order."""

    sum_g: float
    sum_t: float
    sum_gg: float
    sum_tt: float
    sum_gt: float
    sum_abs_diff: float
    max_abs_diff: float
    max_rel_diff: float
    outside: float  # pairs outside the similarity tolerance


def _chunk_stats(pair, d, a, b, atol: float, rtol: float) -> list[torch.Tensor]:
    """float64 sums and maxima over one chunk of all-finite pairs (0-d tensors, no sync), in
    the order of :class:`_ChunkStats`.

    ``pair``: (2, m) float64, golden in row 0, target in row 1; d, a, b: scratch of m.
    """
    g, t = pair[0], pair[1]
    out = list(pair.sum(1).unbind())
    out += [torch.dot(g, g), torch.dot(t, t), torch.dot(g, t)]
    torch.sub(t, g, out=d)
    d.abs_()  # |t - g|, bitwise what (t.double() - g.double()).abs() gives
    out.append(d.sum())
    out.append(d.amax())
    torch.abs(g, out=a)
    torch.add(a, REL_TINY, out=b)
    torch.div(d, b, out=b)
    out.append(b.amax())  # max relative difference
    a.mul_(rtol).add_(atol)  # tolerance: atol + rtol * |g|, same rounding as isclose
    torch.gt(d, a, out=b)  # 1.0 where outside the tolerance
    out.append(b.sum())
    return out


class _CentredStats(NamedTuple):
    """One chunk's sums of the second Pearson pass, with golden ``a = g - mean(g)`` and
    target ``b = t - mean(t)``, and the extremes of g and t, on the host: what
    :func:`_centred_stats` computes, in this order."""

    sum_a: float
    sum_b: float
    sum_ab: float
    sum_aa: float
    sum_bb: float
    min_g: float
    max_g: float
    min_t: float
    max_t: float


def _centred_stats(g, t, a, b, mg: float, mt: float) -> list[torch.Tensor]:
    """Second Pearson pass over one chunk of all-finite pairs, in the order of
    :class:`_CentredStats`."""
    torch.sub(g, mg, out=a)
    torch.sub(t, mt, out=b)
    return [
        a.sum(),
        b.sum(),
        torch.dot(a, b),
        torch.dot(a, a),
        torch.dot(b, b),
        g.amin(),
        g.amax(),
        t.amin(),
        t.amax(),
    ]


def _to_host(rows: list[list[torch.Tensor]]) -> list[list[float]]:
    if not rows:
        return []
    return torch.stack([torch.stack(r) for r in rows]).cpu().tolist()


def _clamp_unit(x: float) -> float:
    if math.isnan(x):
        return x
    return min(1.0, max(-1.0, x))


def _pearson_needs_two_pass(sg, st, sgg, stt, sgt, n) -> bool:
    """True when the one-pass formula could be off by more than ~1e-11 relative.

    Its rounding error on r is about eps * sqrt(cond_g * cond_t) (times a small factor for
    the summation) with cond = E[x^2] / Var[x]; it is used only when that is below
    100 * |r| and both condition numbers are below 100 (worst seen in 300 random
    cases of mixed dtypes, means and noise levels: 2.4e-13 relative).
    """
    mg, mt = sg / n, st / n
    vg = sgg / n - mg * mg
    vt = stt / n - mt * mt
    if not (vg > 0.0 and vt > 0.0):
        return True
    cg, ct = (sgg / n) / vg, (stt / n) / vt
    if not (math.isfinite(cg) and math.isfinite(ct)):
        return True
    if cg > _PEARSON_COND_LIMIT or ct > _PEARSON_COND_LIMIT:
        return True
    r = (sgt / n - mg * mt) / (math.sqrt(vg) * math.sqrt(vt))
    return math.sqrt(cg * ct) > _PEARSON_COND_LIMIT * abs(r)


# --------------------------------------------------------------------------- public API


def compare_tensors(
    golden,
    target,
    *,
    floor=None,
    sim_atol: float = 1e-2,
    sim_rtol: float = 1e-2,
    chunk_elements: int | None = None,
) -> Metrics:
    """Compare ``target`` with ``golden`` element-wise; see the module docstring.

    ``floor`` (optional, same shape): typically the float32 evaluation of the same layer;
    when given, ``noise_ratio`` is filled in (see :func:`noise_ratio`).
    ``sim_atol``/``sim_rtol``: an element counts as similar when
    ``|t - g| <= sim_atol + sim_rtol * |g|``.
    ``chunk_elements``: elements per chunk (bounds the extra memory); default by device.
    """
    golden = _as_tensor(golden, "golden")
    target = _as_tensor(target, "target")
    _check_shapes(golden, target, "target")
    if floor is not None:
        floor = _as_tensor(floor, "floor")
        _check_shapes(golden, floor, "floor")
    atol, rtol = float(sim_atol), float(sim_rtol)
    if not (atol >= 0.0 and rtol >= 0.0):
        raise ValueError(f"sim_atol and sim_rtol must be >= 0, got {sim_atol!r}, {sim_rtol!r}")
    if chunk_elements is not None and int(chunk_elements) <= 0:
        raise ValueError(f"chunk_elements must be positive, got {chunk_elements!r}")
    if golden.numel() == 0:
        return Metrics(
            max_abs_diff=0.0,
            mean_abs_diff=0.0,
            similarity_percentage=100.0,
            cosine_similarity=1.0,
            pearson_correlation=1.0,
            numel=0,
            golden_nan=0,
            golden_inf=0,
            target_nan=0,
            target_inf=0,
            worst_index=(),
            worst_golden=0.0,
            worst_target=0.0,
            max_rel_diff=0.0,
            noise_ratio=None if floor is None else 0.0,
        )

    with torch.no_grad():
        return _compare(golden, target, floor, atol, rtol, chunk_elements)


def _compare(golden, target, floor, atol, rtol, chunk_elements) -> Metrics:
    inputs = [golden, target] + ([floor] if floor is not None else [])
    with _Chunks(inputs, chunk_elements, nscratch=3) as ch:
        return _compare_chunks(ch, inputs, chunk_elements, atol, rtol)


def _first_pass(ch: _Chunks, chunks: range, atol: float, rtol: float) -> tuple[list, list]:
    """Pass 1 over ``chunks``: each chunk's statistics, assuming it is finite (checked
    afterwards), and its noise sums where there is a floor."""
    rows: list[list[torch.Tensor]] = []
    noise_rows: list[list[torch.Tensor]] = []
    for i in chunks:
        pair, rest = ch.load(i)
        d, a, b = ch.scratch_for(pair.shape[1])
        rows.append(_chunk_stats(pair, d, a, b, atol, rtol))
        if rest:
            noise_rows.append(_noise_sums(pair[0], pair[1], rest[0], a, b))
    return rows, noise_rows


#: The CPU pass is shared out when it has at least this many chunks per thread.
_CHUNKS_PER_THREAD = 4
_pool: ThreadPoolExecutor | None = None


def _first_pass_shared(ch: _Chunks, inputs: list[torch.Tensor], chunk_elements, atol, rtol) -> tuple[list, list]:
    """:func:`_first_pass` over all chunks; on the CPU, with enough of them, shared out over
    torch's threads as contiguous runs of chunks, each run one Python thread whose
    operations run on one thread. Splitting each small operation over the threads instead
    makes every one wait for all of them: on a busy machine each then waits on a thread the
    OS has descheduled (32M bf16 pairs beside another process's 2-thread matmul loop: 0.05
    GB/s that way, against 0.4 GB/s on one thread). Each chunk's sums are the same either way."""
    global _pool
    threads = min(torch.get_num_threads(), ch.nchunks // _CHUNKS_PER_THREAD)
    if ch.device.type != "cpu" or threads < 2:
        return _first_pass(ch, range(ch.nchunks), atol, rtol)
    bounds = [ch.nchunks * k // threads for k in range(threads + 1)]

    def run(k: int) -> tuple[list, list]:
        with _Chunks(inputs, chunk_elements, nscratch=3) as own:  # each thread's own buffers
            return _first_pass(own, range(bounds[k], bounds[k + 1]), atol, rtol)

    before = torch.get_num_threads()
    if _pool is None or _pool._max_workers < threads:
        _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="layerparity-metrics")
    torch.set_num_threads(1)
    try:
        parts = list(_pool.map(run, range(threads)))
    finally:
        torch.set_num_threads(before)
    return [r for part in parts for r in part[0]], [r for part in parts for r in part[1]]


class _Totals(NamedTuple):
    """The statistics of the chunks that hold finite pairs, added up: sums exactly
    (:func:`math.fsum` of the per-chunk float64 sums), maxima over the chunks."""

    n: int  # the pairs where both values are finite
    sum_g: float
    sum_t: float
    sum_gg: float
    sum_tt: float
    sum_gt: float
    sum_abs_diff: float
    max_abs_diff: float
    max_rel_diff: float
    outside: float

    @classmethod
    def of(cls, chunks: list[_ChunkStats], n: int) -> _Totals:
        def total(name: str) -> float:
            return math.fsum(getattr(c, name) for c in chunks)

        return cls(
            n=n,
            sum_g=total("sum_g"),
            sum_t=total("sum_t"),
            sum_gg=total("sum_gg"),
            sum_tt=total("sum_tt"),
            sum_gt=total("sum_gt"),
            sum_abs_diff=total("sum_abs_diff"),
            max_abs_diff=max(c.max_abs_diff for c in chunks),
            max_rel_diff=max(c.max_rel_diff for c in chunks),
            outside=total("outside"),
        )


@dataclass
class _NonFinite:
    """What the revisit of the chunks holding NaN or Inf found."""

    chunks: set[int]  # the chunks revisited (their statistics are over their finite pairs)
    counts: tuple[int, int, int, int] = (0, 0, 0, 0)  # golden NaN, golden Inf, target NaN, target Inf
    first_mismatch: int | None = None  # the first position finite in one tensor only


def _compare_chunks(ch: _Chunks, inputs: list[torch.Tensor], chunk_elements, atol: float, rtol: float) -> Metrics:
    """The metrics of ``inputs`` (golden, target and maybe a floor) from their chunks
    ``ch``: pass 1 assumes every chunk finite, the chunks that are not are revisited with
    masks, then the sums are added up and the Pearson correlation and the worst element are
    found (each reading the chunks again only when it must)."""
    rows, noise_rows = _first_pass_shared(ch, inputs, chunk_elements, atol, rtol)
    stats: list[_ChunkStats | None] = [_ChunkStats._make(r) for r in _to_host(rows)]  # the fast path's only sync
    npairs = [ch.bounds(i)[1] - ch.bounds(i)[0] for i in range(ch.nchunks)]
    found = _revisit_non_finite(ch, stats, npairs, atol, rtol)

    n = sum(npairs)
    live = [i for i in range(ch.nchunks) if stats[i] is not None]
    if n == 0:
        nan = float("nan")
        max_abs = mean_abs = sim = cos = pear = max_rel = nan
        worst = found.first_mismatch if found.first_mismatch is not None else 0
    else:
        totals = _Totals.of([stats[i] for i in live], n)
        max_abs, max_rel = totals.max_abs_diff, totals.max_rel_diff
        mean_abs = totals.sum_abs_diff / n
        sim = 100.0 * (n - totals.outside) / n
        cos = _cosine(totals)
        pear = _pearson(ch, live, found.chunks, totals)
        if found.first_mismatch is not None:
            worst = found.first_mismatch
        else:
            worst = _first_maximum(ch, stats, live, found.chunks, max_abs)

    return Metrics(
        max_abs_diff=float(max_abs),
        mean_abs_diff=float(mean_abs),
        similarity_percentage=float(sim),
        cosine_similarity=float(cos),
        pearson_correlation=float(pear),
        numel=int(ch.numel),
        golden_nan=int(found.counts[0]),
        golden_inf=int(found.counts[1]),
        target_nan=int(found.counts[2]),
        target_inf=int(found.counts[3]),
        worst_index=_unravel(int(worst), tuple(inputs[0].shape)),
        worst_golden=float(ch.flat[0][worst].item()),
        worst_target=float(ch.flat[1][worst].item()),
        max_rel_diff=float(max_rel),
        noise_ratio=_noise_ratio_of(noise_rows, 1e-12) if len(inputs) > 2 else None,
    )


def _revisit_non_finite(
    ch: _Chunks, stats: list[_ChunkStats | None], npairs: list[int], atol: float, rtol: float
) -> _NonFinite:
    """Revisit the chunks holding NaN or Inf (their float64 sums are not finite): count them,
    find the first position finite in one tensor only, and put the chunk's statistics over
    its finite pairs (None where it has none) and their number into ``stats`` and ``npairs``."""
    slow = [i for i, s in enumerate(stats) if not (math.isfinite(s.sum_g) and math.isfinite(s.sum_t))]
    found = _NonFinite(chunks=set(slow))
    for i in slow:
        pair, _ = ch.load(i)
        g, t = pair[0], pair[1]
        c = torch.stack(
            [torch.isnan(g).sum(), torch.isinf(g).sum(), torch.isnan(t).sum(), torch.isinf(t).sum()]
        ).tolist()
        found.counts = tuple(x + y for x, y in zip(found.counts, c, strict=False))
        fg, ft = torch.isfinite(g), torch.isfinite(t)
        if found.first_mismatch is None:
            mism = torch.nonzero(fg ^ ft)
            if mism.numel():
                found.first_mismatch = ch.bounds(i)[0] + int(mism[0, 0])
        both = fg & ft
        sub = pair[:, both]
        m = sub.shape[1]
        npairs[i] = m
        if m:
            scratch = [torch.empty(m, dtype=torch.float64, device=ch.device) for _ in range(3)]
            stats[i] = _ChunkStats._make(torch.stack(_chunk_stats(sub, *scratch, atol, rtol)).tolist())
        else:
            stats[i] = None
    return found


def _cosine(totals: _Totals) -> float:
    """1.0 for two zero tensors, 0.0 when one is zero."""
    sgg, stt = totals.sum_gg, totals.sum_tt
    if sgg == 0.0 and stt == 0.0:
        return 1.0
    if sgg == 0.0 or stt == 0.0:
        return 0.0
    return _clamp_unit(totals.sum_gt / (math.sqrt(sgg) * math.sqrt(stt)))


def _pearson(ch: _Chunks, live: list[int], slow: set[int], totals: _Totals) -> float:
    """From the one-pass sums when they are well conditioned, else by a second, centred pass
    over the ``live`` chunks (see :func:`_pearson_needs_two_pass`)."""
    sg, st, sgg, stt, sgt, n = totals.sum_g, totals.sum_t, totals.sum_gg, totals.sum_tt, totals.sum_gt, totals.n
    if _pearson_needs_two_pass(sg, st, sgg, stt, sgt, n):
        return _pearson_two_pass(ch, live, slow, sg / n, st / n, n, totals.max_abs_diff)
    mg, mt = sg / n, st / n
    cov = sgt / n - mg * mt
    return _clamp_unit(cov / (math.sqrt(sgg / n - mg * mg) * math.sqrt(stt / n - mt * mt)))


def _first_maximum(
    ch: _Chunks, stats: list[_ChunkStats | None], live: list[int], slow: set[int], max_abs: float
) -> int:
    """The flat position of the first largest |t - g|: the first chunk holding the maximum,
    then the first maximum within it (non-finite differences left out)."""
    wi = next(i for i in live if stats[i].max_abs_diff == max_abs)
    pair, _ = ch.load(wi)
    d = ch.scratch_for(pair.shape[1])[0]
    torch.sub(pair[1], pair[0], out=d).abs_()
    if wi in slow:
        d = torch.where(torch.isfinite(d), d, torch.full_like(d, -1.0))
    return ch.bounds(wi)[0] + int(torch.argmax(d))


def _pearson_two_pass(ch: _Chunks, live, slow_set, mg: float, mt: float, n: int, max_abs: float) -> float:
    rows = []
    for i in live:
        pair, _ = ch.load(i)
        g, t = pair[0], pair[1]
        if i in slow_set:
            both = torch.isfinite(g) & torch.isfinite(t)
            g, t = g[both], t[both]
            a, b = torch.empty_like(g), torch.empty_like(g)
        else:
            a, b = ch.scratch_for(g.numel())[:2]
        rows.append(_centred_stats(g, t, a, b, mg, mt))
    host = [_CentredStats._make(r) for r in _to_host(rows)]
    sa, sb, sab, saa, sbb = (
        math.fsum(getattr(r, k) for r in host) for k in ("sum_a", "sum_b", "sum_ab", "sum_aa", "sum_bb")
    )
    # zero variance is decided exactly (min == max), not from a rounded variance
    g_const = min(r.min_g for r in host) == max(r.max_g for r in host)
    t_const = min(r.min_t for r in host) == max(r.max_t for r in host)
    if g_const and t_const:
        return 1.0 if max_abs == 0.0 else 0.0
    if g_const or t_const:
        return 0.0
    # corrected two-pass: remove what is left of the mean in the centred values
    cov = sab - sa * sb / n
    vg = max(saa - sa * sa / n, 0.0)
    vt = max(sbb - sb * sb / n, 0.0)
    if vg == 0.0 or vt == 0.0:
        return 0.0
    return _clamp_unit(cov / (math.sqrt(vg) * math.sqrt(vt)))


def _noise_sums(g, t, r, a, b) -> list[torch.Tensor]:
    torch.sub(t, r, out=a)
    torch.sub(g, r, out=b)
    return [torch.dot(a, a), torch.dot(b, b)]


def _noise_ratio_of(rows: list[list[torch.Tensor]], eps: float) -> float:
    """The noise ratio from the chunks' :func:`_noise_sums`."""
    host = _to_host(rows)
    return _ratio(math.fsum(r[0] for r in host), math.fsum(r[1] for r in host), eps)


def _ratio(num_sq: float, den_sq: float, eps: float) -> float:
    if num_sq == 0.0 and den_sq == 0.0:
        return 0.0
    return math.sqrt(num_sq) / (math.sqrt(den_sq) + eps)


def noise_ratio(golden, target, floor, eps: float = 1e-12) -> float:
    """``||target - floor||_2 / (||golden - floor||_2 + eps)``, all in float64.

    ``floor`` is typically the float32 evaluation of the same layer: a ratio near 1 says
    the target is no further from it than the golden is (the target is as accurate as the
    golden's own low-precision run). 0.0 when both norms are 0. Taken over all elements, so
    a NaN or Inf anywhere makes the result NaN or Inf.
    """
    golden = _as_tensor(golden, "golden")
    target = _as_tensor(target, "target")
    floor = _as_tensor(floor, "floor")
    _check_shapes(golden, target, "target")
    _check_shapes(golden, floor, "floor")
    if golden.numel() == 0:
        return 0.0
    with torch.no_grad(), _Chunks([golden, target, floor], None, nscratch=2) as ch:
        rows = []
        for i in range(ch.nchunks):
            pair, (r,) = ch.load(i)
            a, b = ch.scratch_for(r.numel())
            rows.append(_noise_sums(pair[0], pair[1], r, a, b))
        return _noise_ratio_of(rows, float(eps))


def min_passing_tolerance(golden, target) -> dict:
    """The smallest tolerances with which ``torch.allclose(target, golden)`` would pass.

    ``{"atol": max |t-g|`` (passes with rtol=0), ``"rtol": max |t-g|/|g|`` over ``g != 0``
    (passes with atol=0; ``inf`` when some ``g == 0`` has ``t != g``)``}``, in float64.
    Equal values (equal infinities included) always pass; a NaN, or an infinity that the
    other tensor does not match exactly, makes both ``inf`` (no tolerance passes).
    Empty tensors: both 0.0.
    """
    golden = _as_tensor(golden, "golden")
    target = _as_tensor(target, "target")
    _check_shapes(golden, target, "target")
    inf = float("inf")
    if golden.numel() == 0:
        return {"atol": 0.0, "rtol": 0.0}
    maxima = []
    with torch.no_grad(), _Chunks([golden, target], None, nscratch=0) as ch:
        zero = torch.zeros((), dtype=torch.float64, device=ch.device)
        for i in range(ch.nchunks):
            pair, _ = ch.load(i)
            g, t = pair[0], pair[1]
            eq = g == t
            d = torch.where(eq, zero, (t - g).abs())  # NaN/Inf where no tolerance can pass
            ratio = torch.where(eq, zero, d / g.abs())  # g == 0 != t -> inf
            maxima.append(torch.stack([d.amax(), ratio.amax()]))
        host = torch.stack(maxima).cpu().tolist()
    if not all(math.isfinite(x[0]) for x in host):
        return {"atol": inf, "rtol": inf}
    return {"atol": max(x[0] for x in host), "rtol": max(x[1] for x in host)}
