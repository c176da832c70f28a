"""How many perturbed runs the whole model's envelope needs: correct ports and planted bugs
through the whole-model test (teacher-forced logits on torch-xla), each judged against the
envelope of the first K runs of one extraction (its whole-model envelope made of max(K)
runs, 12 by default; the runs' seeds are BASE_SEED + k, so the first K of twelve are what an
extraction with K runs makes; the plugin's default is 7).

    PJRT_DEVICE=CPU python bench/bench_model_k.py [--dtypes bfloat16,float32,float16] [--ks 4,6,8,12]
                                                  [--seq-len 32] [--embedded-seeds 16]

The greedy-flip check's near-tie bound takes the margins flipped in all max(K) runs for every
K (the envelope keeps them together) and the margin drifts of the first K; the KL limit and
the logit scale's range are the envelope's own rules on the first K runs. Each K is judged
three ways: the plugin's rule, "KL alone" (no logit scale) and "flips only" (no margin drift:
the near-tie bound before the drift was kept). Each correct port's line shows its flips and
the runs' drifts. The decoders of bench_verdicts.py, 4 layers, 32 tokens (or ``--seq-len``), 2
decode steps; each bug of bench_verdicts.BUGS planted in the middle layer, and bugs after the
last layer (``AFTER_LAST_LAYER``: the final norm's weight or the LM head scaled). One process holds
every compiled program: at 128 tokens run the decoders in two halves (``--models``), as
bench_verdicts.py does in processes of its own.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench_verdicts as bv
import torch
from scratch import work_folder

from pytest_layerparity.compare import logits as logits_module
from pytest_layerparity.compare.logits import ModelEnvelope
from pytest_layerparity.reference import model_golden as reference_model_golden
from pytest_layerparity.store.golden import MODEL_LOGITS_KEY, GoldenStore

#: Each layer's perturbed runs in the bench's extractions: the plugin's default. The whole
#: model's envelope takes max(--ks) runs whatever the layers' (the plugin's rule,
#: ``model_envelope_samples``, would make it 7 of 12).
LAYER_SAMPLES = 12


#: The rules each K is also judged by: the KL alone (no logit scale), and the near-tie bound
#: of the runs' flipped margins alone (no margin drift: the rule before the drift was kept).
VARIANTS = ("", "KL alone", "flips only")


def _variant(envelope: ModelEnvelope, variant: str) -> ModelEnvelope:
    if variant == "KL alone":
        return ModelEnvelope(envelope.kl_median, envelope.flip_margins, (), envelope.margin_drift)
    if variant == "flips only":
        return ModelEnvelope(envelope.kl_median, envelope.flip_margins, envelope.logit_scale)
    return envelope


def judged_at(ks: list[int], run, show: str | None = None) -> dict[tuple[int, str], bool]:
    """``run()`` (one whole-model test) judged at each K and by each of ``VARIANTS``: whether
    it fails. ``show``: print that label, the target's flips and the runs' margin drifts."""
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
        for variant in VARIANTS:
            judged = original(golden, logits, dtype, tie, rate, _variant(envelope.first(k), variant))
            out[k, variant] = not judged.passed
    if show is not None:
        stats = logits_module.logits_stats(golden, logits)
        margins = ", ".join(f"{m:.3g}" for m in stats.margins[:6]) or "-"
        drift = ", ".join(f"{d:.3g}" for d in envelope.margin_drift)
        flips = max(envelope.flip_margins, default=0.0)
        print(f"  {show}: flips at margins {margins}; runs' largest flipped margin {flips:.3g}, margin drift {drift}")
    return out


def _final_norm(model):
    for name, module in model.named_modules():
        if name.split(".")[-1] in ("norm", "final_layernorm", "final_layer_norm", "ln_f") and hasattr(module, "weight"):
            return module
    return None


#: Bugs after the last layer (no layer test sees them): the model built with the change.
AFTER_LAST_LAYER = {
    "final norm weight x0.95": lambda m: _final_norm(m).weight.mul_(0.95),
    "final norm weight x0.99": lambda m: _final_norm(m).weight.mul_(0.99),
    "LM head x0.98": lambda m: m.get_output_embeddings().weight.mul_(0.98),
}


def judged_with(ks: list[int], session, entry, change) -> dict[int, bool]:
    """The whole-model test judged at each K, the target's model (the model's own, as the
    target runs it) with ``change`` made to it after it is built."""
    from pytest_layerparity.model import steps as target_model

    original = target_model.hf_step

    def changed(model):
        with torch.no_grad():
            change(model)
        return original(model)

    target_model.hf_step = changed
    try:
        return judged_at(ks, lambda: session.target.parity_model(entry))
    finally:
        target_model.hf_step = original


def embedded_seeds(ks: list[int], seeds: int) -> None:
    """The embedded model's committed whole-model golden, its envelope made anew with
    ``seeds`` base seeds (1000, 2000, ...): how often each K catches the final norm's weight
    x0.9, with the logit scale and by the KL alone, and the range of the KL's limit."""
    from transformers import AutoModelForCausalLM

    from pytest_layerparity.compare.logits import judge_logits
    from pytest_layerparity.model.steps import hf_step, teacher_forced
    from pytest_layerparity.noise import perturbed_runs as reference_envelope
    from pytest_layerparity.reference.model_golden import whole_model_envelope

    model_dir = ROOT / "fixtures" / "minimax_m2_tiny"
    golden = GoldenStore(ROOT / "fixtures" / "goldens" / "minimax_m2_tiny").load(MODEL_LOGITS_KEY).tensors
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    broken = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        _final_norm(broken).weight.mul_(0.9)
    logits = teacher_forced(hf_step(broken), golden["input_ids"], golden.get("decode_ids"), "cpu")
    caught = {k: [0, 0] for k in ks}
    limits: dict[int, list[float]] = {k: [] for k in ks}
    seed = reference_envelope.BASE_SEED
    try:
        for s in range(seeds):
            reference_envelope.BASE_SEED = 1000 * (s + 1)
            envelope = whole_model_envelope(hf_step(model), golden, "cpu", max(ks))
            for k in ks:
                first = envelope.first(k)
                alone = _variant(first, "KL alone")
                caught[k][0] += not judge_logits(golden, logits, "bfloat16", 0.01, 0.001, first).passed
                caught[k][1] += not judge_logits(golden, logits, "bfloat16", 0.01, 0.001, alone).passed
                limits[k].append(first.kl_limit(0.001))
    finally:
        reference_envelope.BASE_SEED = seed
    print(f"\nthe embedded model, its final norm's weight x0.9, over {seeds} envelope seeds")
    for k in ks:
        print(
            f"{k:>3}: caught {caught[k][0]} of {seeds} ({caught[k][1]} by the KL alone); "
            f"KL limit {min(limits[k]):.2g} to {max(limits[k]):.2g}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16,float32,float16")
    parser.add_argument("--ks", default="4,6,8,12")
    parser.add_argument(
        "--models",
        default=",".join(bv.DECODERS),
        help="the decoders (default: bench_verdicts.py's); any other of fixtures/tiny_models.py's by name (held out)",
    )
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument(
        "--embedded-seeds", type=int, default=0, help="only the embedded model's final-norm bug over N envelope seeds"
    )
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    from tiny_models import ARCHITECTURES

    unknown = sorted(set(args.models.split(",")) - set(ARCHITECTURES))
    if unknown:
        parser.error(f"--models: no decoder {', '.join(unknown)}; choose among {', '.join(sorted(ARCHITECTURES))}")
    if args.embedded_seeds:
        embedded_seeds(ks, args.embedded_seeds)
        return
    reference_model_golden.model_envelope_samples = lambda _samples: max(ks)
    work = work_folder("model-k-")
    started = time.time()
    both = [(k, variant) for variant in VARIANTS for k in ks]
    alarms = {k: [] for k in both}
    caught = dict.fromkeys(both, 0)
    bugs_run = 0
    after, after_run, passed_after = dict.fromkeys(both, 0), 0, {k: [] for k in both}
    for name, model, extra in bv.models(work, 4, tuple(args.models.split(","))):
        for dtype in args.dtypes.split(","):
            store = work / f"{name}-{dtype}"
            bv.extract(model, store, extra, dtype, range(4), LAYER_SAMPLES, seq_len=args.seq_len)
            entry = GoldenStore(store).load(MODEL_LOGITS_KEY)
            port = bv.session(model, store, extra, target="xla")
            correct = judged_at(ks, lambda s=port, e=entry: s.target.parity_model(e), f"{name} {dtype}")
            for k in both:
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
            for label, change in AFTER_LAST_LAYER.items():
                session = bv.session(model, store, extra, target="xla")
                for k, failed in judged_with(ks, session, entry, change).items():
                    after[k] += failed
                    if not failed:
                        passed_after[k].append(f"{name} {dtype} {label}")
                after_run += 1
            so_far = ", ".join(f"K={k} {caught[k, '']}" for k in ks)
            print(f"{name} {dtype} done ({time.time() - started:.0f} s); bugs caught so far of {bugs_run}: {so_far}")
    elapsed = time.time() - started
    print(f"\nwhole-model test against the first K perturbed runs, {args.seq_len} tokens ({elapsed:.0f} s)")
    print(f"{'K':>16} {'false alarms':>14} {'bugs caught':>14}")
    models = len(args.models.split(",")) * len(args.dtypes.split(","))
    labels = {(k, variant): f"{k}{f' ({variant})' if variant else ''}" for k, variant in both}
    for key in both:
        row = f"{len(alarms[key]):>6} of {models:<5} {caught[key]:>6} of {bugs_run:<5}"
        print(f"{labels[key]:>16} {row}  {'; '.join(alarms[key])}")
    print(f"\nbugs after the last layer ({', '.join(AFTER_LAST_LAYER)}), caught of {after_run}")
    for key in both:
        print(f"{labels[key]:>16} {after[key]:>6}  passed: {'; '.join(passed_after[key]) or '-'}")


if __name__ == "__main__":
    main()
