"""A test's stated detection limits against the smallest planted error it is measured to catch.

Per model and dtype: goldens of a few layers extracted (the default envelope), the middle
layer's correct port run on the target (torch-xla by default) for its prompt test and its
decode steps, and what each says it sees (``compare.sight``: the attention's output scaled,
the MLP's output scaled, the attention scores scaled, the norms' epsilon raised). Then each
kind is planted in the same layer through the build hook, at sizes bisected (geometrically,
to within 6%) between one that passes and one that fails, and the smallest caught is held
against the stated limit: the ratio stated / measured, per kind, dtype and test (the prompt
test; the decode test, which fails when any step does, states the smallest of its steps').
Raised sizes only (a scale or temperature up, the epsilon up), as the limit's ``high``.

The plants: a forward hook scaling the branch module's output (the module the golden stores
the direction of), every attention score scaled by ``SofterAttention`` around the layer's
call, every norm's epsilon multiplied. The calibration models (MiniMax-M2, Llama) are where
the stated limit's rules were checked first; the others are reported apart.

    PJRT_DEVICE=CPU python bench/bench_detection.py [--models ...] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_verdicts import CALIBRATION_MODELS, DECODE_STEPS, extract, models, planted, session
from scratch import work_folder

from pytest_layerparity.compare.floor import branch_directions
from pytest_layerparity.compare.parts import direction_part
from pytest_layerparity.noise.directions import SofterAttention, norm_epsilons, output_scaler
from pytest_layerparity.selection import decode_key, layer_key
from pytest_layerparity.store.golden import GoldenStore

KINDS = ("attention_scale", "mlp_scale", "temperature", "norm_epsilon")
DEFAULT_MODELS = "minimax_m2,llama,qwen2,mixtral,gpt_neox,qwen3,gemma2"
#: Bisections of the bracket (a factor 16 each side of the stated limit, widened until it holds).
BISECTIONS = 6
#: The trained decoders --trained takes (fixtures/trained_models.py).
TRAINED = ("gemma3_270m", "qwen25_coder_05b")
BRACKET = 16.0


def branch_of(store: Path, at: int, part: str) -> str | None:
    """The name of the branch module of ``part`` whose direction the golden stores."""
    names = branch_directions(GoldenStore(store).load(layer_key(at)).tensors)
    return next((n for n in names if direction_part(n) == part and n != "gelu_form"), None)


def plant(kind: str, size: float, branch: str | None):
    """A port with ``kind`` off by ``size`` (a fraction; for the epsilon, the factor less one)."""

    def scale_output(layer, config):
        layer.get_submodule(branch).register_forward_hook(output_scaler(1 + size))
        return layer

    def sharper(layer, config):
        mode = SofterAttention(1 + size)

        def enter(*_):
            mode.__enter__()  # a pre-hook's return value would replace the call's arguments

        def leave(*_):
            mode.__exit__(None, None, None)

        layer.register_forward_pre_hook(enter)
        layer.register_forward_hook(leave)
        return layer

    def epsilon(layer, config):
        for module, attribute, value in norm_epsilons(layer):
            setattr(module, attribute, value * (1 + size))
        return layer

    return {"temperature": sharper, "norm_epsilon": epsilon}.get(kind, scale_output)


def smallest_caught(caught, stated: float | None, largest: float) -> float | None:
    """The smallest size ``caught`` fails on, bisected geometrically from a bracket around
    ``stated``; None where ``largest`` passes."""
    low, high = (stated / BRACKET, stated * BRACKET) if stated else (1e-4, 1e-2)
    high = min(high, largest)
    while caught(low) and low > 1e-9:
        low /= BRACKET
    while not caught(high):
        if high >= largest:
            return None
        low, high = high, min(high * BRACKET, largest)
    for _ in range(BISECTIONS):
        middle = math.sqrt(low * high)
        low, high = (low, middle) if caught(middle) else (middle, high)
    return high


def stated_size(limit) -> float | None:
    if limit is None or limit.high is None:
        return None
    return limit.high - 1 if limit.kind == "norm_epsilon" else limit.high


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--target", default="xla")
    parser.add_argument(
        "--trained", default="", help="trained decoders of fixtures/trained_models.py too (e.g. gemma3_270m): held out"
    )
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    work = work_folder("detection-")
    rows = []
    started = time.time()
    cases = models(work, args.layers, tuple(args.models.split(","))) if args.models else []
    for name in filter(None, args.trained.split(",")):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures"))
        from trained_models import ensure

        cases.append((name, ensure(name), {}))
    for name, model, extra in cases:
        count = len(session(model, work / "probe", extra).model.layer_list[1])
        for dtype in args.dtypes.split(","):
            store = work / f"{name}-{dtype}"
            # a generated model's layers all extracted; a trained one's middle layer alone
            extract(
                model, store, extra, dtype, list(range(count)) if args.layers >= count else [count // 2], args.samples
            )
            for row in measured(model, extra, store, count // 2, args.target):
                rows.append((name, dtype, *row))
                kind, test, stated, found = row
                print(
                    f"{name:<11} {dtype:<9} {kind:<16} {test:<7} stated {fmt(kind, stated):>10} measured "
                    f"{fmt(kind, found):>10}  ratio {ratio(stated, found)} ({time.time() - started:.0f} s)",
                    flush=True,
                )
    report(rows)


def measured(model, extra, store: Path, mid: int, target: str):
    """Per kind and test of layer ``mid``: (kind, test, stated, smallest caught), raised."""
    stored = GoldenStore(store).read_manifest()["files"]
    steps = [step for step in range(DECODE_STEPS) if decode_key(mid, step) in stored]
    correct = session(model, store, extra, target=target)
    prompt = correct.parity_layer(mid).sight
    decode = [o.sight for o in correct.target.parity_decode(mid, steps)] if steps else []
    for kind in KINDS:
        branch = branch_of(store, mid, {"attention_scale": "attention", "mlp_scale": "mlp"}.get(kind, ""))
        if kind in ("attention_scale", "mlp_scale") and branch is None:
            continue

        def run(size, kind=kind, branch=branch):
            return session(model, store, extra, planted(plant(kind, size, branch), mid), target=target)

        largest = 1e6 if kind == "norm_epsilon" else 1.0
        if prompt is not None and kind in prompt.by_kind():
            stated = stated_size(prompt.by_kind()[kind])
            yield (
                kind,
                "prompt",
                stated,
                smallest_caught(lambda s, run=run: not run(s).parity_layer(mid).passed, stated, largest),
            )
        found = [stated_size(s.by_kind()[kind]) for s in decode if s is not None and kind in s.by_kind()]
        if found:
            stated = min((f for f in found if f is not None), default=None)  # the test fails when any step does

            def caught(size, run=run):
                return any(not o.passed for o in run(size).target.parity_decode(mid, steps))

            yield kind, "decode", stated, smallest_caught(caught, stated, largest)


def fmt(kind: str, size: float | None) -> str:
    if size is None:
        return "none"
    return f"x{1 + size:.3g}" if kind == "norm_epsilon" else f"{100 * size:.3g}%"


def ratio(stated: float | None, measured: float | None) -> str:
    if stated is None or measured is None:
        return "-" if stated == measured else "one only"
    return f"{stated / measured:.2f}"


def report(rows: list) -> None:
    print("\nstated / measured smallest caught (raised), per split, dtype, test and kind: median [min, max], n")
    print("within 2 = both limits found and the ratio within [0.5, 2]; 'one only': a size found on one side alone")
    groups: dict = {}
    for name, dtype, kind, test, stated, measured in rows:
        trained = name in TRAINED or name.startswith("minilm")
        split = "calibration" if name in CALIBRATION_MODELS else "evaluation, trained" if trained else "evaluation"
        groups.setdefault((split, dtype, test, kind), []).append((stated, measured))
    for key, pairs in sorted(groups.items()):
        ratios = [s / m for s, m in pairs if s is not None and m is not None]
        within = sum(0.5 <= r <= 2 for r in ratios) + sum(s is None and m is None for s, m in pairs)
        spread = f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]" if ratios else "-"
        print(f"  {' '.join(key):<52} {spread:<22} within 2: {within} of {len(pairs)}")


if __name__ == "__main__":
    main()
