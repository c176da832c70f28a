"""Could a layer's spread come from its tokens instead of from K runs? Each envelope
statistic is a sum over tokens; were the tokens' errors independent, the variance of the sum
over the runs would be the sum of the tokens' own variances (many more degrees of freedom
than K - 1). This prints, per layer, the ratio of the one to the other (1: pooling holds).

    PJRT_DEVICE=CPU python bench/bench_pooling.py [--models llama,qwen3_moe,phi,bert]
                                                  [--dtypes bfloat16] [--runs 24] [--seq-len 32]

For layers 1 and 2 of each of bench_verdicts.py's generated models, the prompt and the first
decode step (one token: 1 by construction): ``R_bias`` for the error along the layer's
contribution (``contribution_bias`` before its units), ``R_sq`` for the squared error (the
noise ratio's numerator), each over all the runs and over each half of them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_verdicts as bv
import torch
from scratch import work_folder

from pytest_layerparity.compare.floor import FLOOR_KEY
from pytest_layerparity.noise.perturbed_runs import PerturbedRunner
from pytest_layerparity.selection import decode_key
from pytest_layerparity.store.callspec import hidden_input_name


def ratio(sums: list[float], per_token: torch.Tensor) -> float:
    """The variance of the sums over the runs against the sum of the tokens' variances."""
    return statistics.variance(sums) / float(per_token.var(0).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama,qwen3_moe,phi,bert")
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--runs", type=int, default=24)
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args()
    work = work_folder("pooling-")
    half = args.runs // 2
    for name, model, extra in bv.models(work, 4, tuple(args.models.split(","))):
        for dtype in args.dtypes.split(","):
            store = work / f"{name}-{dtype}".replace(" ", "_")
            bv.extract(model, store, extra, dtype, [1, 2], 12, "cpu", seq_len=args.seq_len)
            session = bv.session(model, store, extra, target="xla")
            stored = session.store.read_manifest()["files"]
            for index in (1, 2):
                for key in (f"layer_{index}", decode_key(index, 0)):
                    if key not in stored:
                        continue
                    entry = session.target.load_golden(key)
                    spec, tensors = entry.metadata["call"], entry.tensors
                    floor = tensors[FLOOR_KEY].double()
                    rows = floor.reshape(-1, floor.shape[-1])
                    along = rows - tensors[hidden_input_name(spec)].double().reshape(rows.shape)
                    bias, squares = [], []
                    for run in PerturbedRunner(session.model, getattr(torch, dtype), args.runs).runs(
                        index, spec, tensors
                    ):
                        error = run.output.double().reshape(rows.shape) - rows
                        bias.append((error * along).sum(-1))
                        squares.append((error * error).sum(-1))
                    b, q = torch.stack(bias), torch.stack(squares)
                    b_sums, q_sums = [float(t.sum()) for t in b], [float(t.sum()) for t in q]
                    print(
                        f"{name:<12} {dtype:<9} {key:<18} tokens {rows.shape[0]:>4}  R_bias {ratio(b_sums, b):5.2f} "
                        f"(halves {ratio(b_sums[:half], b[:half]):5.2f} {ratio(b_sums[half:], b[half:]):5.2f})  "
                        f"R_sq {ratio(q_sums, q):5.2f} "
                        f"(halves {ratio(q_sums[:half], q[:half]):5.2f} {ratio(q_sums[half:], q[half:]):5.2f})",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
