"""Programs built on the compiled NxDI path (``--port nxdi --target neuron``): before and after
one build per program.

    PJRT_DEVICE=CPU .venv-nxdi/bin/python bench/bench_compile_once.py

Runs ``pytest --port nxdi --target neuron`` in fresh processes, in the NxDI environment, on the
six-layer Llama of tests/nxdi (fixtures/nxdi/llama6, its goldens: a 32-token prompt and 2
decode steps, float32) with the CPU stand-in of NxDI's ``build_module``
(tests/nxdi/standin_build_module.py, which records each build and each weight load), for layer
0 alone (its prompt and decode tests) and for the whole suite (6 layers' prompt and decode
tests, the whole model). On Trainium each build is a ModelBuilder trace and a neuronx-cc run
of minutes; a weight load is a shard and a copy to the device.

"Before" is today's count measured before the change (each layer and call shape its own
program: the prompt pass, each decode step, and the whole model building every layer again):
the old code path no longer exists to be run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "fixtures" / "nxdi" / "llama6"
GOLDENS = ROOT / "fixtures" / "goldens" / "nxdi" / "llama6-float32"
STANDIN = f"""
import sys
sys.path.insert(0, {str(ROOT / "tests" / "nxdi")!r})
from standin_build_module import pytest_layerparity_nxdi_build_module
"""

#: (label, -k expression, tests, builds measured before the change)
CASES = [
    ("layer 0 alone (prompt, 2 decode steps)", "layer_0", 2, 3),
    ("6 layers, 2 decode steps, whole model", None, 13, 36),
]


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def measure(select: str | None) -> tuple[str, list[dict], list[dict], list[str]]:
    """One session: its summary line, the builds, the weight loads, the compile-cache entries."""
    with tempfile.TemporaryDirectory() as run_dir:
        here = Path(run_dir)
        (here / "conftest.py").write_text(STANDIN)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--port", "nxdi"]
        command += ["--target", "neuron", f"--model={MODEL}", f"--golden-dir={GOLDENS}", "--compile-cache=cc"]
        command += ["-k", select] if select else []
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")}
        done = subprocess.run(command, cwd=here, env=env, capture_output=True, text=True, check=False)
        summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
        apps = here / "cc" / "nxdi"
        entries = sorted(str(p.relative_to(apps)) for p in apps.glob("*/*")) if apps.exists() else []
        return summary, lines(here / "builds.jsonl"), lines(here / "loads.jsonl"), entries


def main() -> None:
    print(f"model {MODEL.relative_to(ROOT)} (6 layers), goldens {GOLDENS.relative_to(ROOT)}, CPU stand-in builder")
    print(f"{'case':42} {'tests':>5} {'builds before':>13} {'builds after':>12} {'weight loads':>12}  pytest")
    for label, select, tests, before in CASES:
        summary, builds, loads, entries = measure(select)
        print(f"{label:42} {tests:>5} {before:>13} {len(builds):>12} {len(loads):>12}  {summary}")
        for b in builds:
            kind = "decode" if len(b["example"]) > 3 else "prompt"
            shapes = " ".join("x".join(map(str, shape)) for shape, _ in b["example"])
            print(f"    built with layer {b['index']}: {kind} program, inputs {shapes}")
        print(f"    compile-cache entries: {', '.join(entries)}")
    print("62 layers of one kind (MiniMax-M2's), 2 decode steps: 372 builds before (62 x 3, twice), 2 after")


if __name__ == "__main__":
    main()
