"""Benchmark pytest_layerparity.compare.metrics.compare_tensors against the obvious float32 code.

    python bench/bench_metrics.py                      # 1M, 4M, 16M, 32M, 128M bf16 pairs
    python bench/bench_metrics.py --sizes 1,4,16,32    # skip 128M (needs ~3 GB RAM)
    python bench/bench_metrics.py --dtype fp32

For each size it prints the input throughput (both tensors' bytes / best wall time) of
compare_tensors and of a plain float32 implementation of the five metrics, run in the same
process on the same data, and the cosine each returns for identical inputs. Then, in fresh
subprocesses, the peak extra memory of one call on 32M elements: the peak RSS (VmHWM,
the counter behind ru_maxrss, reset just before the call through /proc/self/clear_refs)
minus the RSS before the call. Then, at 32M, the engine and plain float64 torch code (the
exact way to get the same figures) on a quiet machine and beside another torch process
running a matmul loop on its own threads (what a second xdist worker or another job is).
This is a script, not a test.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
MI = 1 << 20


def naive_float32(g, t, atol=1e-2, rtol=1e-2):
    """The obvious implementation: everything in float32 torch ops."""
    import torch
    import torch.nn.functional as F

    g32, t32 = g.float().flatten(), t.float().flatten()
    d = (g32 - t32).abs()
    return {
        "max_abs_diff": d.max().item(),
        "mean_abs_diff": d.mean().item(),
        "similarity_percentage": torch.isclose(t32, g32, rtol=rtol, atol=atol).float().mean().item() * 100,
        "cosine_similarity": F.cosine_similarity(g32, t32, dim=0).item(),
        "pearson_correlation": torch.corrcoef(torch.stack([g32, t32]))[0, 1].item(),
    }


def make_pair(n: int, dtype_name: str, seed: int = 0):
    """golden and a slightly perturbed target, built chunk-wise (no big temporaries)."""
    import torch

    dtype = getattr(torch, DTYPES[dtype_name])
    gen = torch.Generator().manual_seed(seed)
    g = torch.empty(n, dtype=dtype)
    t = torch.empty(n, dtype=dtype)
    step = 1 << 22
    for s in range(0, n, step):
        e = min(n, s + step)
        x = torch.randn(e - s, generator=gen)
        g[s:e] = x
        t[s:e] = x + 1e-2 * torch.randn(e - s, generator=gen)
    return g, t


def exact_float64(g, t):
    """The exact figures the plain way: everything widened to float64 torch tensors."""
    g64, t64 = g.double().flatten(), t.double().flatten()
    d = (g64 - t64).abs()
    return d.max().item(), d.mean().item(), (g64 @ t64).item(), (g64 @ g64).item(), (t64 @ t64).item()


COMPETITOR = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
a = torch.randn(1024, 1024)
while True:
    a @ a
"""


def busy_table(n: int, dtype_name: str, repeats: int) -> None:
    """Engine and float64 torch, quiet and beside a competing process on its own threads."""
    import torch

    from pytest_layerparity.compare.metrics import compare_tensors

    g, t = make_pair(n, dtype_name)
    nbytes = g.numel() * g.element_size() * 2
    threads = torch.get_num_threads()
    print(f"\n{n // MI}M {dtype_name} pairs, this process on {threads} threads:")
    print(f"{'beside':>34} | {'engine':>10} {'float64 torch':>14} | ratio")
    for rival in (0, threads):
        proc = subprocess.Popen([sys.executable, "-c", COMPETITOR, str(rival)]) if rival else None
        try:
            if proc is not None:
                time.sleep(2)  # the rival's loop is running
            t_ours = best_time(lambda: compare_tensors(g, t), repeats)
            t_f64 = best_time(lambda: exact_float64(g, t), repeats)
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
        where = f"a matmul loop on {rival} threads" if rival else "nothing (quiet)"
        print(
            f"{where:>34} | {nbytes / t_ours / 1e9:>5.2f} GB/s {nbytes / t_f64 / 1e9:>9.2f} GB/s | "
            f"{t_f64 / t_ours:.1f}x",
            flush=True,
        )


def best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run_table(sizes_m: list[int], dtype_name: str, repeats: int) -> None:
    import torch

    from pytest_layerparity.compare.metrics import compare_tensors

    print(
        f"{'elements':>9} {'MiB in':>7} | {'compare_tensors':>16} {'float32 naive':>14} | "
        f"{'cos(x,x) ours':>18} {'cos(x,x) naive':>18}"
    )
    compare_tensors(torch.ones(10), torch.ones(10))  # load libraries before timing
    for size in sizes_m:
        n = size * MI
        g, t = make_pair(n, dtype_name)
        nbytes = g.numel() * g.element_size() + t.numel() * t.element_size()
        reps = repeats if n <= 32 * MI else max(2, repeats // 2)
        t_ours = best_time(lambda g=g, t=t: compare_tensors(g, t), reps)
        t_naive = best_time(lambda g=g, t=t: naive_float32(g, t), reps)
        cos_ours = compare_tensors(g, g).cosine_similarity
        cos_naive = naive_float32(g, g)["cosine_similarity"]
        print(
            f"{size:>8}M {nbytes / MI:>7.0f} | {nbytes / t_ours / 1e9:>10.2f} GB/s {nbytes / t_naive / 1e9:>9.2f} "
            "GB/s | "
            f"{cos_ours:>18.15f} {cos_naive:>18.15f}",
            flush=True,
        )
        del g, t


_MEM_CHILD = r"""
import resource, sys, torch
sys.path.insert(0, {root!r})
from bench.bench_metrics import make_pair, naive_float32
from pytest_layerparity.compare.metrics import compare_tensors
g, t = make_pair({n}, {dtype!r})
# warm up on tiny data (loads MKL, thread pools), not big enough to pre-grow the heap
compare_tensors(g[:4096], t[:4096]); naive_float32(g[:4096], t[:4096])
def status_mib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
try:  # hand freed heap back to the OS, so the call cannot reuse it unseen
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)
except OSError:
    pass
try:  # reset the peak-RSS counter (VmHWM) so earlier temporaries do not mask the call's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    reset = status_mib("VmHWM") <= status_mib("VmRSS") + 1
except OSError:
    reset = False
before = status_mib("VmRSS")
before_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
if {which!r} == "ours":
    compare_tensors(g, t)
else:
    naive_float32(g, t)
if reset:
    peak = status_mib("VmHWM")
else:  # ru_maxrss never decreases: this under-reports if an earlier peak was higher
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, before_peak)
print(peak - before, int(reset))
"""


def peak_extra_mib(which: str, n: int, dtype_name: str) -> tuple[float, bool]:
    code = _MEM_CHILD.format(root=ROOT, n=n, dtype=dtype_name, which=which)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    delta, reset = out.stdout.split()
    return float(delta), reset == "1"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4,16,32,128", help="sizes in Mi elements (default 1,4,16,32,128)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--repeats", type=int, default=5, help="best of N timings (halved above 32M)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--no-busy", action="store_true", help="skip the table beside a competing process")
    args = ap.parse_args()

    import torch

    print(
        f"machine: platform.processor()={platform.processor()!r}, cpu={cpu_model()!r}, "
        f"{os.cpu_count()} logical CPUs, {platform.platform()}"
    )
    print(f"torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}")
    print(f"inputs: {args.dtype} pairs, GB/s = bytes of both inputs / best wall time\n")
    run_table([int(s) for s in args.sizes.split(",") if s], args.dtype, args.repeats)

    if not args.no_memory:
        n = 32 * MI
        print(
            f"\npeak extra memory at {n // MI}M {args.dtype} pairs "
            f"(peak RSS minus RSS before, fresh process, inputs {2 * n * (4 if args.dtype == 'fp32' else 2) / MI:.0f} "
            "MiB):"
        )
        for which in ("ours", "naive"):
            label = "compare_tensors" if which == "ours" else "float32 naive"
            delta, reset = peak_extra_mib(which, n, args.dtype)
            how = "VmHWM reset before the call" if reset else "ru_maxrss delta"
            print(f"  {label:<16} {delta:8.1f} MiB  ({how})", flush=True)
    if not args.no_busy:
        busy_table(32 * MI, args.dtype, args.repeats)


if __name__ == "__main__":
    main()
