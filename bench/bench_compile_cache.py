"""Compile reuse on the torch-xla device: across sessions (--compile-cache) and within one.

    PJRT_DEVICE=CPU python bench/bench_compile_cache.py            # default model, all 6 layers
    PJRT_DEVICE=CPU python bench/bench_compile_cache.py --layers 0-2 --skip-batched

Runs ``pytest --xla`` on the embedded MiniMax-M2 (fixtures/minimax_m2_tiny, its committed
goldens) in fresh processes:

1. twice with ``--compile-cache=DIR`` on an empty DIR: per-layer time of the first session
   (compiles and stores) against the second (finds the stored graphs), and their ratio;
2. within each session: the first layer against the later ones, with the number of XLA
   compilations each layer caused (torch-xla's CompileTime metric);
3. unless --skip-batched, one more session in which the layers' MoE experts use
   transformers' ``batched_mm`` implementation instead of the ``eager`` one the plugin uses on
   lazy devices (set through the build hook), to show what graph reuse a static-shape experts
   path gives: eager experts loop over the experts a router picked, so each layer's graph
   differs with its routing.

Per-layer time is the test's call phase: building the layer from the checkpoint, running it
on the device, comparing. Prints one table per question.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "fixtures" / "minimax_m2_tiny"
GOLDENS = ROOT / "fixtures" / "goldens" / "minimax_m2_tiny"

TIMING_CONFTEST = """
import json, os, time
import pytest

ROWS = []

class Timing:
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        import torch_xla.debug.metrics as met

        def snap():
            data = met.metric_data("CompileTime")
            return (data[0], data[1]) if data else (0, 0)

        before, start = snap(), time.perf_counter()
        try:
            return (yield)
        finally:
            after = snap()
            ROWS.append({"test": item.name, "seconds": time.perf_counter() - start,
                         "compiles": after[0] - before[0], "compile_seconds": (after[1] - before[1]) / 1e9})

def pytest_configure(config):
    config.pluginmanager.register(Timing(), "bench-timing")

def pytest_sessionfinish(session):
    import torch_xla.debug.metrics as met

    names = ("PersistentCacheHit", "PersistentCacheMiss", "PersistentCacheDeserializeFailure", "CachedCompile")
    counters = {k: int(met.counter_value(k) or 0) for k in names}
    with open(os.environ["BENCH_OUT"], "w") as f:
        json.dump({"rows": ROWS, "counters": counters}, f)

if os.environ.get("BENCH_EXPERTS"):
    import copy

    @pytest.hookimpl
    def pytest_layerparity_build_target_layer(layer_idx, reference_layer, model_config, device):
        for module in reference_layer.modules():
            if hasattr(module, "gate_up_proj") and hasattr(module, "config"):
                config = copy.copy(module.config)
                config._experts_implementation = os.environ["BENCH_EXPERTS"]
                module.config = config
        return None
"""


def run_session(work: Path, name: str, args: list[str], env_extra: dict[str, str] | None = None) -> dict:
    out = work / f"{name}.json"
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"), BENCH_OUT=str(out), **(env_extra or {}))
    command = [sys.executable, "-m", "pytest", "--xla", "-p", "no:cacheprovider", "-q", *args]
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not out.exists():
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"session {name} failed (exit {done.returncode})")
    result = json.loads(out.read_text())
    result["summary"] = [line for line in done.stdout.splitlines() if line.startswith("layerparity: compile cache")]
    return result


def layer_rows(result: dict) -> dict[str, dict]:
    return {row["test"].split("[")[-1].rstrip("]"): row for row in result["rows"]}


def within_session(name: str, result: dict) -> None:
    rows = result["rows"]
    print(f"\n{name}: within the session")
    print(f"  {'layer':<10} {'seconds':>8} {'compiles':>9} {'compile s':>10}")
    for row in rows:
        print(
            f"  {row['test'].split('[')[-1].rstrip(']'):<10} {row['seconds']:8.3f} {row['compiles']:9d} "
            f"{row['compile_seconds']:10.3f}"
        )
    if len(rows) > 1:
        rest = rows[1:]
        mean = sum(r["seconds"] for r in rest) / len(rest)
        compiles = sum(r["compiles"] for r in rest) / len(rest)
        print(
            f"  first layer {rows[0]['seconds']:.3f} s ({rows[0]['compiles']} compiles); later layers {mean:.3f} s "
            f"({compiles:.1f} compiles) on average: ratio later/first {mean / rows[0]['seconds']:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="all")
    parser.add_argument("--skip-batched", action="store_true", help="skip the batched_mm experts session")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    options = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-compile-cache-"))
    try:
        shutil.copytree(GOLDENS, work / "goldens")
        (work / "pytest.ini").write_text(f"[pytest]\nlayerparity_model = {MODEL}\nlayerparity_golden_dir = goldens\n")
        (work / "conftest.py").write_text(TIMING_CONFTEST)
        cache = work / "xla-cache"
        args = ["--layers", options.layers, f"--compile-cache={cache}"]
        first = run_session(work, "first", args)
        stored = len(list(cache.iterdir()))
        second = run_session(work, "second", args)

        import torch_xla

        print(
            f"torch-xla {torch_xla.__version__}, PJRT_DEVICE={os.environ.get('PJRT_DEVICE', 'CPU')}, model "
            f"{MODEL.name}, "
            f"{os.cpu_count()} CPUs; experts: eager (the plugin's choice on lazy devices)"
        )
        print(f"\nacross sessions, --compile-cache={cache} ({stored} graphs stored by the first session)")
        print(f"  {'layer':<10} {'1st s':>8} {'2nd s':>8} {'2nd/1st':>8} {'1st compiles':>13} {'2nd compiles':>13}")
        a, b = layer_rows(first), layer_rows(second)
        for layer in a:
            print(
                f"  {layer:<10} {a[layer]['seconds']:8.3f} {b[layer]['seconds']:8.3f} "
                f"{b[layer]['seconds'] / a[layer]['seconds']:8.3f} "
                f"{a[layer]['compiles']:13d} {b[layer]['compiles']:13d}"
            )
        total_a = sum(r["seconds"] for r in a.values())
        total_b = sum(r["seconds"] for r in b.values())
        print(f"  {'all':<10} {total_a:8.3f} {total_b:8.3f} {total_b / total_a:8.3f}")
        for name, result in (("first", first), ("second", second)):
            print(f"  {name} session counters: {result['counters']}")
            for line in result["summary"]:
                print(f"    {line}")

        within_session("first session (eager experts)", first)
        if not options.skip_batched:
            batched = run_session(work, "batched", ["--layers", options.layers], {"BENCH_EXPERTS": "batched_mm"})
            within_session("one session, experts batched_mm (no cache)", batched)
    finally:
        if options.keep:
            print(f"\nwork folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
