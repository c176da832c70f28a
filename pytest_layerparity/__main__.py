"""``python -m pytest_layerparity compare GOLDEN_DIR TARGET_DIR``: compare two stores of
per-layer outputs (goldens, and a target's ``--save-outputs``) without running a model."""
from __future__ import annotations

import argparse
import fnmatch
import sys
from dataclasses import replace
from pathlib import Path


def _settings(args: argparse.Namespace):
    from .options import make_settings

    return make_settings(verdict=args.verdict, max_noise_ratio=args.max_noise_ratio)


def compare_stores(golden_dir: str, target_dir: str, pattern: str, settings) -> list[dict]:
    from .capture import hidden_input_name, primary_output_name
    from .golden import GoldenStore
    from .report import properties
    from .routing import agreement, router_names
    from .session import REF_OUTPUT, LayerParitySession

    golden, target = GoldenStore(golden_dir), GoldenStore(target_dir)
    manifest = golden.read_manifest()
    if manifest is None:
        raise SystemExit(f"error: {golden_dir} is not a golden store (no manifest.json)")
    if target.read_manifest() is None:
        raise SystemExit(f"error: {target_dir} is not a store of outputs (no manifest.json); write one with --save-outputs")
    keys = sorted((k for k in set(golden.keys()) & set(target.keys()) if fnmatch.fnmatch(k, pattern) and k.startswith("layer_")),
                  key=lambda k: int(k.split("_")[1]))
    if not keys:
        raise SystemExit(f"error: no layer matches {pattern!r} in both {golden_dir} and {target_dir}")
    session = LayerParitySession(replace(settings, dtype=manifest.get("dtype"), golden_dir=golden_dir), Path.cwd())
    entries = []
    for key in keys:
        g, t = golden.load(key), target.load(key)
        spec = g.metadata["call"]
        name = primary_output_name(spec)
        routing = [r for r in (agreement(n, g.tensors, t.tensors, session.tie_tolerance) for n in router_names(g.tensors)) if r]
        index = int(key.split("_")[1])
        outcome = session.compare(index, g.tensors[name], t.tensors[name], reference=g.tensors.get(REF_OUTPUT),
                                  hidden_in=g.tensors.get(hidden_input_name(spec)), routing=routing)
        props = dict(properties(outcome))
        entries.append({"nodeid": f"compare::{key}", "layers": str(index), "verdict": "pass" if outcome.passed else "fail",
                        "metrics": props, "message": "" if outcome.passed else _failure(outcome)})
    return entries


def _failure(outcome) -> str:
    from .report import failure_text

    return failure_text(outcome, "(offline compare)", "rerun the layer on the target with -k layer_N")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pytest_layerparity", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    cmp_ = sub.add_parser("compare", help="Compare a golden store with a store of target outputs.")
    cmp_.add_argument("golden_dir")
    cmp_.add_argument("target_dir")
    cmp_.add_argument("--layer-pattern", default="layer_*", help="Which layers (fnmatch on layer_N). Default: layer_*.")
    cmp_.add_argument("--report", default=None, metavar="DIR", help="Write report.json, report.csv and report.html here.")
    cmp_.add_argument("--verdict", choices=("noise", "table"), default="noise")
    cmp_.add_argument("--max-noise-ratio", type=float, default=None)
    args = parser.parse_args(argv)
    from .golden import GoldenError
    from .report import summary_lines, write_reports

    try:
        entries = compare_stores(args.golden_dir, args.target_dir, args.layer_pattern, _settings(args))
    except GoldenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in summary_lines(entries):
        print(line)
    for entry in entries:
        if entry["message"]:
            print(entry["message"])
    if args.report:
        Path(args.report).mkdir(parents=True, exist_ok=True)
        for path in write_reports(args.report, entries):
            print(f"wrote {path}")
    return 1 if any(e["verdict"] != "pass" for e in entries) else 0


if __name__ == "__main__":
    sys.exit(main())
