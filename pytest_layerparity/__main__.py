"""``python -m pytest_layerparity compare GOLDEN_DIR TARGET_DIR``: compare two stores of
per-layer outputs (goldens, and a target's ``--save-outputs``) without running a model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .options import Settings


def _settings(args: argparse.Namespace) -> Settings:
    from .options import make_settings

    return make_settings(verdict=args.verdict, max_noise_ratio=args.max_noise_ratio)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pytest_layerparity", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    cmp_ = sub.add_parser("compare", help="Compare a golden store with a store of target outputs.")
    cmp_.add_argument("golden_dir")
    cmp_.add_argument("target_dir")
    cmp_.add_argument("--layer-pattern", default="layer_*", help="Which layers (fnmatch on layer_N). Default: layer_*.")
    cmp_.add_argument(
        "--report", default=None, metavar="DIR", help="Write report.json, report.csv and report.html here."
    )
    cmp_.add_argument("--verdict", choices=("noise", "table"), default="noise")
    cmp_.add_argument("--max-noise-ratio", type=float, default=None)
    args = parser.parse_args(argv)
    from .offline import NothingToCompare, compare_stores
    from .report.files import write_reports
    from .report.text import summary_lines
    from .store.golden import GoldenError

    try:
        entries = compare_stores(args.golden_dir, args.target_dir, args.layer_pattern, _settings(args))
    except NothingToCompare as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except GoldenError as exc:  # a store that cannot be read
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in summary_lines(entries):
        print(line)
    for entry in entries:
        if entry.message:
            print(entry.message)
    if args.report:
        Path(args.report).mkdir(parents=True, exist_ok=True)
        for path in write_reports(args.report, entries):
            print(f"wrote {path}")
    return 1 if any(e.verdict != "pass" for e in entries) else 0


if __name__ == "__main__":
    sys.exit(main())
