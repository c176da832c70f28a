"""Compilations and wall time of the main job on the torch-xla device, this tree against an
earlier revision, in one run.

    PJRT_DEVICE=CPU python bench/bench_xla_compiles.py                 # against HEAD's first parent
    PJRT_DEVICE=CPU python bench/bench_xla_compiles.py --before 8526b3c --repeats 2

Each revision's package (this working tree, and ``--before`` checked out into a temporary git
worktree) runs ``pytest --xla`` on the embedded MiniMax-M2 (fixtures/minimax_m2_tiny, its
committed goldens) in fresh processes: layer 0's prompt test alone, the prompt tests of all 6
layers, the decode-step tests of all 6 layers, and the whole main job. For each it prints
torch-xla's compilations (the CompileTime metric, counted over each test's call) and the
session's wall time (the pytest process, start to exit; best of ``--repeats``), and for the
main job its ratio to layer 0's prompt test alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

COUNTING_PLUGIN = """
import json, os
import pytest

ROWS = []

@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    import torch_xla.debug.metrics as met

    def compiles():
        data = met.metric_data("CompileTime")
        return data[0] if data else 0

    before = compiles()
    try:
        return (yield)
    finally:
        ROWS.append({"test": item.name, "compiles": compiles() - before})

def pytest_sessionfinish(session):
    with open(os.environ["BENCH_OUT"], "w") as f:
        json.dump({"rows": ROWS, "failed": session.testsfailed}, f)
"""

SESSIONS = (
    ("layer 0, prompt", ["-k", "test_layer_parity and layer_0"]),
    ("6 layers, prompt", ["-k", "test_layer_parity"]),
    ("6 layers, decode steps", ["-k", "test_layer_decode_parity"]),
    ("main job (13 tests)", []),
)


def run(tree: Path, work: Path, args: list[str]) -> tuple[float, int, int, int]:
    """(wall seconds, compilations, tests, failed) of one pytest --xla session on ``tree``'s package."""
    out = work / "out.json"
    env = dict(
        os.environ,
        PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"),
        PYTHONPATH=os.pathsep.join([str(tree), str(work)]),
        BENCH_OUT=str(out),
    )
    command = [sys.executable, "-m", "pytest", "--xla", "-p", "bench_counting", "-p", "no:cacheprovider", "-q", *args]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if not out.exists():
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"{tree}: pytest {' '.join(args)} ended without a result (exit {done.returncode})")
    result = json.loads(out.read_text())
    return seconds, sum(r["compiles"] for r in result["rows"]), len(result["rows"]), result["failed"]


def measure(tree: Path, work: Path, repeats: int) -> list[tuple[str, float, int, int, int]]:
    rows = []
    for name, args in SESSIONS:
        runs = [run(tree, work, args) for _ in range(repeats)]
        best = min(runs, key=lambda r: r[0])
        rows.append((name, *best))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="HEAD~1", help="the earlier revision (default HEAD~1)")
    parser.add_argument("--repeats", type=int, default=1, help="sessions per row, best wall time kept")
    options = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-xla-compiles-"))
    before = work / "before"
    try:
        (work / "bench_counting.py").write_text(COUNTING_PLUGIN)
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(before), options.before], cwd=ROOT, check=True)
        revision = subprocess.run(
            ["git", "rev-parse", "--short", options.before], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        trees = ((f"before ({revision})", before), ("this tree", ROOT))
        results = {label: measure(tree, work, options.repeats) for label, tree in trees}
        import torch
        import torch_xla

        print(
            f"torch {torch.__version__}, torch-xla {torch_xla.__version__}, PJRT_DEVICE="
            f"{os.environ.get('PJRT_DEVICE', 'CPU')}, {os.cpu_count()} CPUs; model fixtures/minimax_m2_tiny "
            "(6 layers, bfloat16 goldens, 32-token prompt, 2 decode steps)\n"
        )
        print(f"{'':<24} | " + " | ".join(f"{label:^31}" for label, _ in trees))
        print(f"{'session':<24} | " + " | ".join(f"{'compiles':>9} {'wall s':>8} {'tests':>11}" for _ in trees))
        for i, (name, _) in enumerate(SESSIONS):
            cells = []
            for label, _ in trees:
                _, seconds, compiles, tests, failed = results[label][i]
                cells.append(f"{compiles:>9} {seconds:>8.1f} {f'{tests - failed}/{tests} pass':>11}")
            print(f"{name:<24} | " + " | ".join(cells))
        for label, _ in trees:
            rows = results[label]
            print(f"{label}: main job / layer 0's prompt test alone = {rows[-1][1] / rows[0][1]:.2f}x wall time")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, check=False)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
