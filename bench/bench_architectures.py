"""Every causal-LM architecture the installed transformers has, end to end, as a user runs it:
a tiny checkpoint generated from a small config (``fixtures/any_model.py``: hidden 64, 3
layers covering each kind of layer the architecture has, fixed seed), then
``pytest --gpu-golden --extract`` and ``pytest --xla`` (prompt tests, decode-step tests, the
whole model) with the model's own layers as the port, in each dtype.

    PJRT_DEVICE=CPU python bench/bench_architectures.py [--types llama,gemma2] [--dtypes float32,bfloat16]
                                                        [--jobs 2] [--results results.json]

Each architecture ends in one of: ``pass`` (every test of every dtype passed), ``pass without
decode steps`` (the plugin refused decode steps naming ``--decode-steps 0``, up front or, for
a model that takes a cache argument and returns no cache, once the prompt ran; with it every
other test passed), ``pass where the reference runs`` (every test of the dtypes
where transformers' model itself runs passed; in another its own forward fails, which the
plugin says naming the tensors), ``refused`` (the plugin refused it before any work, naming
the reason: a usage error), ``fail`` (a test failed or errored: a false alarm or a plugin
bug), ``reference fails`` (the model's own forward fails in every dtype), or ``not
generated`` (no tiny checkpoint could be made: not the plugin's verdict).
``--results`` keeps each architecture's row as it ends, so an interrupted sweep goes on where
it stopped; the table is printed from it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "fixtures"))
PROMPT_ONLY = "--decode-steps 0"
TEST_KINDS = {"test_layer_parity": "prompt", "test_layer_decode_parity": "decode", "test_model_parity": "model"}


def run_pytest(args: list[str], cwd: Path, junit: Path, timeout: int) -> tuple[int, str]:
    """One pytest run of the plugin (its own process, one thread): exit code and output."""
    env = dict(os.environ, PJRT_DEVICE="CPU", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}", *args]
    try:
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout} s"
    return done.returncode, done.stdout + done.stderr


def usage_error(output: str) -> str:
    """The plugin's refusal: pytest's ``ERROR: ...`` line of a usage error."""
    lines = [line.removeprefix("ERROR: ") for line in output.splitlines() if line.startswith("ERROR: ")]
    return lines[-1] if lines else output.strip().splitlines()[-1] if output.strip() else "no output"


def outcomes(junit: Path) -> list[tuple[str, str, str]]:
    """(test name, passed|failed|skipped, first line of the failure) per test case."""
    if not junit.exists():
        return []
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "")
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skipped = case.find("skipped") is not None
        message = (bad.get("message") or bad.text or "").strip().splitlines() if bad is not None else []
        state = "failed" if bad is not None else "skipped" if skipped else "passed"
        cases.append((name, state, message[0][:300] if message else ""))
    return cases


def kind_of(test_name: str) -> str:
    return TEST_KINDS.get(test_name.split("[", 1)[0], test_name)


def run_dtype(model: Path, work: Path, dtype: str, timeout: int, extract: tuple[str, ...] = ()) -> dict:
    """Extraction (with ``extract``'s options too), then the target tests, of one dtype: what
    each stage gave."""
    store = work / f"goldens-{dtype}{'-prompt-only' if extract else ''}"
    common = [f"--model={model}", f"--golden-dir={store}"]
    row: dict = {"dtype": dtype}
    started = time.perf_counter()
    command = ["--gpu-golden", "--extract", f"--dtype={dtype}", *extract, *common]
    rc, output = run_pytest(command, work, work / "x.xml", timeout)
    row["extract_s"] = round(time.perf_counter() - started, 1)
    if rc == 4:
        return dict(row, state="refused", reason=usage_error(output))
    if rc != 0:
        failed = [c for c in outcomes(work / "x.xml") if c[1] == "failed"]
        reason = failed[0][2] if failed else usage_error(output)
        if OWN_FAILURE in reason:  # transformers' model does not run in this dtype: no golden to hold a port to
            return dict(row, state="reference fails", reason=reason)
        return dict(row, state="fail", reason=f"extraction: {reason}")
    started = time.perf_counter()
    rc, output = run_pytest(["--xla", *common], work, work / "p.xml", timeout)
    row["parity_s"] = round(time.perf_counter() - started, 1)
    if rc == 4:
        return dict(row, state="refused", reason=f"--xla: {usage_error(output)}")
    cases = outcomes(work / "p.xml")
    counts: dict[str, list[int]] = {}
    for name, state, _ in cases:
        tally = counts.setdefault(kind_of(name), [0, 0])
        tally[0] += 1
        tally[1] += state == "passed"
    row["tests"] = counts
    failed = [f"{name}: {message}" for name, state, message in cases if state != "passed"]
    if rc != 0 or failed or not cases:
        return dict(row, state="fail", reason=failed[0] if failed else usage_error(output))
    return dict(row, state="pass")


def generate(model_type: str, out: Path, layers: int, timeout: int) -> str | None:
    """Make the tiny checkpoint in a process of its own (the seed is the process's); None, or
    why it could not be made."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from any_model import make; from pathlib import Path; "
        "make(sys.argv[2], Path(sys.argv[3]), seed=0, layers=int(sys.argv[4]))"
    )
    command = [sys.executable, "-c", code, str(ROOT / "fixtures"), model_type, str(out), str(layers)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout} s"
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else f"exit code {done.returncode}")[:300]


def sweep_one(model_type: str, dtypes: list[str], layers: int, timeout: int, earlier: dict | None = None) -> dict:
    """One architecture: its checkpoint made, then each dtype (stopping at a refusal); the
    dtypes of an ``earlier`` row are kept and not run again."""
    row: dict = {"type": model_type, "dtypes": list((earlier or {}).get("dtypes") or [])}
    ran = {r["dtype"] for r in row["dtypes"]}
    dtypes = [d for d in dtypes if d not in ran]
    with tempfile.TemporaryDirectory(prefix=f"arch-{model_type}-") as folder:
        work = Path(folder)
        (work / "pytest.ini").write_text("[pytest]\n")  # the sweep's own rootdir, no project settings
        model = work / "model"
        why = generate(model_type, model, layers, timeout)
        if why is not None:
            return dict(row, state="not generated", reason=why)
        if not dtypes:
            return dict(earlier or {}, **row)
        row["architectures"] = ", ".join(json.loads((model / "config.json").read_text()).get("architectures") or [])
        for dtype in dtypes:
            result = run_dtype(model, work, dtype, timeout)
            if result["state"] in ("refused", "fail") and PROMPT_ONLY in result["reason"]:
                # decode steps refused with that fix named (up front, or once the model showed it
                # returns no cache): what the rest gives with it
                result = dict(run_dtype(model, work, dtype, timeout, ("--decode-steps=0",)), refused=result["reason"])
            row["dtypes"].append(result)
            if result["state"] == "refused":
                break
    return dict(row, **row_state(row["dtypes"]))


def row_state(results: list[dict]) -> dict:
    """An architecture's state and reason from its dtypes' results."""
    ran = [r for r in results if r["state"] != "reference fails"]
    states = [r["state"] for r in ran]
    state = "refused" if "refused" in states else "fail" if "fail" in states else "pass"
    reasons = [next((r.get("reason", "") for r in ran if r["state"] == state), "")]
    if state == "pass" and any("refused" in r for r in ran):
        state, reasons = "pass without decode steps", [next(r["refused"] for r in ran if "refused" in r)]
    if state.startswith("pass") and len(ran) < len(results):
        own = next(r for r in results if r["state"] == "reference fails")
        reasons.append(f"{own['dtype']}: {own['reason'].removeprefix('Failed: ')}")
        state = "pass where the reference runs" if ran else "reference fails"
    return {"state": state, "reason": "; ".join(r for r in reasons if r)}


def finished(row: dict, dtypes: list[str]) -> bool:
    """Whether a kept row needs no more runs: every dtype ran, or it ended before any could."""
    if row["state"] in ("refused", "not generated"):
        return True
    return {r["dtype"] for r in row.get("dtypes", [])} >= set(dtypes)


def table(rows: list[dict], dtypes: list[str]) -> list[str]:
    """The markdown table and the counts."""
    import transformers

    lines = [
        f"transformers {transformers.__version__}: {len(rows)} causal-LM model types; "
        + ", ".join(f"{state} {sum(r['state'] == state for r in rows)}" for state in STATES),
        "",
        "| model type | result | " + " | ".join(dtypes) + " | reason |",
        "|---|---|" + "---|" * len(dtypes) + "---|",
    ]
    for row in sorted(rows, key=lambda r: (STATES.index(r["state"]), r["type"])):
        cells = []
        for dtype in dtypes:
            result = next((r for r in row.get("dtypes", []) if r["dtype"] == dtype), None)
            if result is None:
                cells.append("")
                continue
            tests = result.get("tests") or {}
            cells.append(" ".join(f"{kind} {ok}/{n}" for kind, (n, ok) in sorted(tests.items())) or result["state"])
        reason = re.sub(r"\s+", " ", row.get("reason", "")).replace("|", "\\|")
        lines.append(f"| {row['type']} | {row['state']} | " + " | ".join(cells) + f" | {reason} |")
    return lines


STATES = (
    "pass",
    "pass without decode steps",
    "pass where the reference runs",
    "refused",
    "fail",
    "reference fails",
    "not generated",
)
#: How the plugin says the reference model's own forward fails in the dtype asked.
OWN_FAILURE = "the reference model's own forward fails in"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="", help="comma-separated model types (default: every causal-LM type)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--layers", type=int, default=3, help="decoder layers of each generated model")
    parser.add_argument("--jobs", type=int, default=1, help="architectures run side by side (each one thread)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per pytest run")
    parser.add_argument("--results", type=Path, default=None, help="JSON of finished rows (read, then appended)")
    args = parser.parse_args()
    from any_model import causal_lm_types

    dtypes = args.dtypes.split(",")
    types = args.types.split(",") if args.types else causal_lm_types()
    done: dict[str, dict] = {}
    if args.results is not None and args.results.exists():
        done = {row["type"]: row for row in json.loads(args.results.read_text())}
    todo = [t for t in types if t not in done or not finished(done[t], dtypes)]
    started = time.time()

    def one(model_type: str) -> dict:
        row = sweep_one(model_type, dtypes, args.layers, args.timeout, done.get(model_type))
        print(f"{model_type}: {row['state']} {row.get('reason', '')[:160]} ({time.time() - started:.0f} s)", flush=True)
        return row

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for row in pool.map(one, todo):
            done[row["type"]] = row
            if args.results is not None:
                args.results.write_text(json.dumps(list(done.values()), indent=1))
    print(f"\n{len(todo)} architectures in {time.time() - started:.0f} s\n")
    print("\n".join(table([done[t] for t in types if t in done], dtypes)))


if __name__ == "__main__":
    main()
