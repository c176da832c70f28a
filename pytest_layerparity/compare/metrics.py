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

The chunks and their buffers are :mod:`.chunks`'; the Pearson correlation :mod:`.pearson`'s,
the noise ratio :mod:`.noise_ratio`'s and :func:`min_passing_tolerance` :mod:`.tolerance`'s.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

from .chunk_sums import ChunkStats, Totals, chunk_stats
from .chunks import Chunks, as_tensor, check_shapes, to_host
from .noise_ratio import noise_ratio, noise_ratio_of, noise_sums
from .pearson import clamp_unit, pearson
from .tolerance import min_passing_tolerance

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


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    idx = []
    for size in reversed(shape):
        idx.append(flat % size)
        flat //= size
    return tuple(reversed(idx))


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
    golden = as_tensor(golden, "golden")
    target = as_tensor(target, "target")
    check_shapes(golden, target, "target")
    if floor is not None:
        floor = as_tensor(floor, "floor")
        check_shapes(golden, floor, "floor")
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
    with Chunks(inputs, chunk_elements, nscratch=3) as ch:
        return _compare_chunks(ch, inputs, chunk_elements, atol, rtol)


def _first_pass(ch: Chunks, chunks: range, atol: float, rtol: float) -> tuple[list, list]:
    """Pass 1 over ``chunks``: each chunk's statistics, assuming it is finite (checked
    afterwards), and its noise sums where there is a floor."""
    rows: list[list[torch.Tensor]] = []
    noise_rows: list[list[torch.Tensor]] = []
    for i in chunks:
        pair, rest = ch.load(i)
        d, a, b = ch.scratch_for(pair.shape[1])
        rows.append(chunk_stats(pair, d, a, b, atol, rtol))
        if rest:
            noise_rows.append(noise_sums(pair[0], pair[1], rest[0], a, b))
    return rows, noise_rows


#: The CPU pass is shared out when it has at least this many chunks per thread.
_CHUNKS_PER_THREAD = 4
_pool: ThreadPoolExecutor | None = None


def _first_pass_shared(ch: Chunks, inputs: list[torch.Tensor], chunk_elements, atol, rtol) -> tuple[list, list]:
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
        with Chunks(inputs, chunk_elements, nscratch=3) as own:  # each thread's own buffers
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


@dataclass
class _NonFinite:
    """What the revisit of the chunks holding NaN or Inf found."""

    chunks: set[int]  # the chunks revisited (their statistics are over their finite pairs)
    counts: tuple[int, int, int, int] = (0, 0, 0, 0)  # golden NaN, golden Inf, target NaN, target Inf
    first_mismatch: int | None = None  # the first position finite in one tensor only


def _compare_chunks(ch: Chunks, inputs: list[torch.Tensor], chunk_elements, atol: float, rtol: float) -> Metrics:
    """The metrics of ``inputs`` (golden, target and maybe a floor) from their chunks
    ``ch``: pass 1 assumes every chunk finite, the chunks that are not are revisited with
    masks, then the sums are added up and the Pearson correlation and the worst element are
    found (each reading the chunks again only when it must)."""
    rows, noise_rows = _first_pass_shared(ch, inputs, chunk_elements, atol, rtol)
    stats: list[ChunkStats | None] = [ChunkStats._make(r) for r in to_host(rows)]  # the fast path's only sync
    npairs = [ch.bounds(i)[1] - ch.bounds(i)[0] for i in range(ch.nchunks)]
    found = _revisit_non_finite(ch, stats, npairs, atol, rtol)

    n = sum(npairs)
    live = [i for i in range(ch.nchunks) if stats[i] is not None]
    if n == 0:
        nan = float("nan")
        max_abs = mean_abs = sim = cos = pear = max_rel = nan
        worst = found.first_mismatch if found.first_mismatch is not None else 0
    else:
        totals = Totals.of([stats[i] for i in live], n)
        max_abs, max_rel = totals.max_abs_diff, totals.max_rel_diff
        mean_abs = totals.sum_abs_diff / n
        sim = 100.0 * (n - totals.outside) / n
        cos = _cosine(totals)
        pear = pearson(ch, live, found.chunks, totals)
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
        noise_ratio=noise_ratio_of(noise_rows, 1e-12) if len(inputs) > 2 else None,
    )


def _revisit_non_finite(
    ch: Chunks, stats: list[ChunkStats | None], npairs: list[int], atol: float, rtol: float
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
            stats[i] = ChunkStats._make(torch.stack(chunk_stats(sub, *scratch, atol, rtol)).tolist())
        else:
            stats[i] = None
    return found


def _cosine(totals: Totals) -> float:
    """1.0 for two zero tensors, 0.0 when one is zero."""
    sgg, stt = totals.sum_gg, totals.sum_tt
    if sgg == 0.0 and stt == 0.0:
        return 1.0
    if sgg == 0.0 or stt == 0.0:
        return 0.0
    return clamp_unit(totals.sum_gt / (math.sqrt(sgg) * math.sqrt(stt)))


def _first_maximum(ch: Chunks, stats: list[ChunkStats | None], live: list[int], slow: set[int], max_abs: float) -> int:
    """The flat position of the first largest |t - g|: the first chunk holding the maximum,
    then the first maximum within it (non-finite differences left out)."""
    wi = next(i for i in live if stats[i].max_abs_diff == max_abs)
    pair, _ = ch.load(wi)
    d = ch.scratch_for(pair.shape[1])[0]
    torch.sub(pair[1], pair[0], out=d).abs_()
    if wi in slow:
        d = torch.where(torch.isfinite(d), d, torch.full_like(d, -1.0))
    return ch.bounds(wi)[0] + int(torch.argmax(d))
