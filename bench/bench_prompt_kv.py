"""The prompt's KV cache judged: do correct ports still pass every prompt test with the keys and
values the prompt wrote held against the golden's, how far do those statistics sit from their
limits, and what do two bugs only the prompt's cache shows read?

    PJRT_DEVICE=CPU python bench/bench_prompt_kv.py [--models llama,qwen3,mixtral,gemma2,gpt_oss]
        [--dtypes bfloat16,float32] [--targets xla,cpu] [--layers 4] [--samples 12]
        [--trained qwen25_coder_05b,gemma3_270m] [--bugs-everywhere]

Per model (fixtures/tiny_models.py, realistic weights, 64 wide, 2 KV heads) and dtype: goldens
extracted on the CPU (32 random tokens, 2 decode steps, K perturbed runs); then, on each
target, every layer's prompt test with the model's own layer (a correct port: each must pass;
on the CPU also computed one precision wider and cast back, its keys and values kept wide),
and in the middle layer two bugs: the keys' rotary positions rolled by one (token 0's key
rotated as the last token's; the queries right) and KV head 0's keys written to the cache as
head 1's (attention computed right). Printed: per model, dtype and target, the tests, false
alarms, and the largest ``prompt_keys_noise_ratio`` / ``prompt_values_noise_ratio`` as a share
of its limit with the smallest cosine; per bug, whether the prompt test failed, whether its
output checks alone would have, and the keys' noise ratio against its limit. ``--trained``
adds trained decoders (fixtures/trained_models.py; every layer extracted), ``--bugs-everywhere``
plants each bug in every layer in turn (the KV-head swap where there are two KV heads).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "fixtures"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_verdicts import extract, planted, session, wider_port
from planted_ports import RolledKeys, SwappedKvHeads
from scratch import work_folder

MODELS = ("llama", "qwen3", "mixtral", "gemma2", "gpt_oss")
KV_CHECKS = ("prompt_keys_noise_ratio", "prompt_values_noise_ratio")


def bugs(at: int) -> dict:
    return {
        "keys' rotary rolled by one": lambda layer, config: RolledKeys(layer),
        "KV head 0's keys written as head 1's": lambda layer, config: SwappedKvHeads(layer, at),
    }


def kv_heads(model: Path) -> int:
    import json

    config = json.loads((Path(model) / "config.json").read_text())
    config = config.get("text_config", config)
    return int(config.get("num_key_value_heads") or config.get("num_attention_heads") or 1)


def kv_reading(outcome) -> tuple[float, float]:
    """(the largest prompt KV noise ratio as a share of its limit, the smallest prompt KV cosine)."""
    shares = [c.value / c.limit for c in outcome.checks if c.name in KV_CHECKS]
    cosines = [c.value for c in outcome.checks if c.name.startswith("prompt_") and c.name.endswith("_cosine")]
    return max(shares, default=float("nan")), min(cosines, default=float("nan"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--targets", default="xla,cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument(
        "--trained", default="", help="trained decoders of fixtures/trained_models.py too (e.g. qwen25_coder_05b)"
    )
    parser.add_argument("--bugs-everywhere", action="store_true", help="plant each bug in every layer, one at a time")
    args = parser.parse_args()
    from tiny_models import make
    from trained_models import ensure

    work = work_folder("prompt-kv-")
    started = time.time()
    rows, bug_rows, alarms = [], [], []
    generated = [name for name in args.models.split(",") if name]
    cases = [(name, lambda name=name: make(name, work / name, num_layers=args.layers)) for name in generated]
    cases += [(name, lambda name=name: ensure(name)) for name in args.trained.split(",") if name]
    for name, made in cases:
        model = made()
        count = len(session(model, work / "probe", {}).model.layer_list[1])
        layers, mid = list(range(count)), count // 2
        for dtype in args.dtypes.split(","):
            store = work / f"{name}-{dtype}"
            extract(model, store, {}, dtype, layers, args.samples, "cpu")
            ports = [(target, None) for target in args.targets.split(",")]
            ports += [("wider", wider_port)] if "cpu" in args.targets.split(",") else []
            for target, hook in ports:
                readings, judged = [], 0
                for i in layers:
                    # the wider port on the CPU, its experts eager (grouped_mm has no float64)
                    where = {"target": "cpu", "experts_implementation": "eager"} if hook else {"target": target}
                    outcome = session(model, store, {}, hook, **where).parity_layer(i)
                    judged += outcome.prompt_kv == "judged"
                    readings.append(kv_reading(outcome))
                    if not outcome.passed:
                        failed = [f"{c.name} {c.value:.3g} {c.op} {c.limit:.3g}" for c in outcome.checks if not c.ok]
                        alarms.append(f"{name} {dtype} {target} layer {i}: {', '.join(failed)}")
                share = max(r[0] for r in readings)
                cosine = min(r[1] for r in readings)
                rows.append((name, dtype, target, len(layers), judged, share, cosine))
                for at in (layers if args.bugs_everywhere else [mid]) if hook is None else ():
                    for bug, plant in bugs(at).items():
                        if "KV head" in bug and kv_heads(model) < 2:
                            continue  # one KV head: no other to write it as
                        outcome = session(model, store, {}, planted(plant, at), target=target).parity_layer(at)
                        output_alone = all(c.ok for c in outcome.checks if not c.name.startswith("prompt_"))
                        keys = next(c for c in outcome.checks if c.name == "prompt_keys_noise_ratio")
                        caught = not outcome.passed
                        what = f"{bug} (layer {at})" if args.bugs_everywhere else bug
                        bug_rows.append((name, dtype, target, what, caught, output_alone, keys.value, keys.limit))
            print(f"{name} {dtype}: done ({time.time() - started:.0f} s)", flush=True)
    print("\ncorrect ports (the model's own layer), every layer's prompt test")
    print(f"{'model':<9} {'dtype':<9} {'target':<6} {'tests':>5} {'judged':>6} {'max ratio/limit':>15} {'min cos':>10}")
    for name, dtype, target, tests, judged, share, cosine in rows:
        print(f"{name:<9} {dtype:<9} {target:<6} {tests:>5} {judged:>6} {share:>15.3f} {cosine:>10.7f}")
    print(f"false alarms: {len(alarms)} of {sum(r[3] for r in rows)}")
    for alarm in alarms:
        print(f"  {alarm}")
    print("\nbugs in the prompt of " + ("every layer, one at a time" if args.bugs_everywhere else "the middle layer"))
    head = f"{'model':<9} {'dtype':<9} {'target':<6} {'bug':<37} {'caught':>6} {'output alone passes':>19}"
    print(f"{head} {'keys ratio':>11}")
    for name, dtype, target, bug, caught, alone, value, limit in bug_rows:
        keys = f"{value:.3g} <= {limit:.3g}"
        print(f"{name:<9} {dtype:<9} {target:<6} {bug:<37} {caught!s:>6} {alone!s:>19} {keys:>11}")
    print(f"caught: {sum(r[4] for r in bug_rows)} of {len(bug_rows)}; {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
