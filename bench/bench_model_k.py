"""How many perturbed runs the whole model's envelope needs: correct ports and planted bugs
through the whole-model test (teacher-forced logits on torch-xla), each judged against the
envelope of the first K runs of one extraction (K = 12 by default; the runs' seeds are
BASE_SEED + k, so the first K of twelve are what an extraction with K runs makes).

    PJRT_DEVICE=CPU python bench/bench_model_k.py [--dtypes bfloat16,float32,float16] [--ks 4,6,8,12]
                                                  [--seq-len 32]

The greedy-flip check takes the largest near-tie margin over all twelve runs for every K (the
envelope keeps the margins of all runs together); the KL limit is the envelope's own rule on
the first K runs' median KLs. The decoders of bench_verdicts.py, 4 layers, 32 tokens (or
``--seq-len``), 2 decode steps; each bug of bench_verdicts.BUGS planted in the middle layer. One process holds
every compiled program: at 128 tokens run the decoders in two halves (``--models``), as
bench_verdicts.py does in processes of its own.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench_verdicts as bv
import torch

from pytest_layerparity.compare import logits as logits_module
from pytest_layerparity.compare.logits import ModelEnvelope
from pytest_layerparity.store.golden import MODEL_LOGITS_KEY, GoldenStore


def judged_at(ks: list[int], run) -> dict[int, bool]:
    """``run()`` (one whole-model test) judged at each K: whether it fails."""
    seen = []
    original = logits_module.judge_logits

    def recording(golden, logits, dtype, tie_tolerance, rate, envelope=None):
        seen.append((golden, logits, dtype, tie_tolerance, rate, envelope))
        return original(golden, logits, dtype, tie_tolerance, rate, envelope)

    logits_module.judge_logits = recording
    try:
        run()
    finally:
        logits_module.judge_logits = original
    golden, logits, dtype, tie, rate, envelope = seen[-1]
    out = {}
    for k in ks:
        first = ModelEnvelope(envelope.kl_median[:k], envelope.flip_margins)
        out[k] = not original(golden, logits, dtype, tie, rate, first).passed
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16,float32,float16")
    parser.add_argument("--ks", default="4,6,8,12")
    parser.add_argument("--models", default=",".join(bv.DECODERS))
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    work = Path(tempfile.mkdtemp(prefix="model-k-"))
    started = time.time()
    alarms = {k: [] for k in ks}
    caught = dict.fromkeys(ks, 0)
    bugs_run = 0
    for name, model, extra in bv.models(work, 4, tuple(args.models.split(","))):
        for dtype in args.dtypes.split(","):
            store = work / f"{name}-{dtype}"
            bv.extract(model, store, extra, dtype, range(4), max(ks), seq_len=args.seq_len)
            entry = GoldenStore(store).load(MODEL_LOGITS_KEY)
            port = bv.session(model, store, extra, target="xla")
            correct = judged_at(ks, lambda s=port, e=entry: s.target.parity_model(e))
            for k in ks:
                if correct[k]:
                    alarms[k].append(f"{name} {dtype}")
            for plant, _ in bv.BUGS.values():
                session = bv.session(model, store, extra, bv.planted(plant, 2), target="xla")
                probe = bv.session(model, store, extra, target="cpu").model.load_layer(2, getattr(torch, dtype))
                if plant(probe, session.model.layer_config) is None:
                    continue  # the bug does not apply to this model
                bugs_run += 1
                for k, failed in judged_at(ks, lambda s=session, e=entry: s.target.parity_model(e)).items():
                    caught[k] += failed
            so_far = ", ".join(f"K={k} {caught[k]}" for k in ks)
            print(f"{name} {dtype} done ({time.time() - started:.0f} s); bugs caught so far of {bugs_run}: {so_far}")
    elapsed = time.time() - started
    print(f"\nwhole-model test against the first K perturbed runs, {args.seq_len} tokens ({elapsed:.0f} s)")
    print(f"{'K':>3} {'false alarms':>14} {'bugs caught':>14}")
    models = len(args.models.split(",")) * len(args.dtypes.split(","))
    for k in ks:
        print(f"{k:>3} {len(alarms[k]):>6} of {models:<5} {caught[k]:>6} of {bugs_run:<5}  {'; '.join(alarms[k])}")


if __name__ == "__main__":
    main()
