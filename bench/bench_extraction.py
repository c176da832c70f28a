"""Golden extraction against a plain forward of the same model: what capture, the precision
floor and writing cost.

    python bench/bench_extraction.py [--layers 8] [--seq-len 512] [--device cuda] [--ieee-matmul]
                                     [--logits-topk 0] [--one-at-a-time] [--model-runs N] [--no-perturbation]

Model loading and the one-time import of ``torch._dynamo`` (which the first perturbed op
would pay) are timed separately and left out of every ratio. One process, on the CPU or
(``--device cuda``) the model and the goldens' runs on the GPU; ``--ieee-matmul`` times the
perturbed runs' wide matmuls of 16-bit operands in IEEE float32, as before they were computed
in 16-bit arithmetic that holds such operands exactly (noise/wider.py's
exact_fast_matmul: TF32 on CUDA, oneDNN's bfloat16 mode on the CPU). ``--no-perturbation``
runs the envelopes' runs in the model's own arithmetic (their limits then mean nothing): the
least that many runs cost. ``--logits-topk 0``
extracts no whole-model golden (``layerparity_logits_topk = 0``), and so no whole-model
envelope: per-layer verdicts alone. ``--one-at-a-time`` runs each call's perturbed runs one
after the other, as the CPU does for a long call (noise/batching.py), to time what running
them together as one batch saves on an accelerator. ``--model-runs N`` makes the whole model's
envelope of N perturbed runs instead of the plugin's rule (half a layer's and one). The
extraction with the floor is also shown in parts: the floor's passes, the layers' envelopes,
the whole model's envelope and the rest, each against the same forwards.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "fixtures"))

import torch
from scratch import work_folder

from pytest_layerparity.options import make_settings
from pytest_layerparity.session import LayerParitySession

WIDTH = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 8000,
}


settings = make_settings

#: The parts of the extraction with the floor timed apart: (label, module, owner's name or None,
#: function). Each is timed where it is called, so a part inside another is not counted twice.
PHASES = (
    ("the precision floor's passes", "pytest_layerparity.noise.wide_pass", "FloorEvaluator", "evaluate"),
    ("the layers' envelopes (K runs a call)", "pytest_layerparity.noise.perturbed_runs", "PerturbedRunner", "envelope"),
    ("the whole model's envelope", "pytest_layerparity.reference.model_golden", None, "whole_model_envelope"),
)


def time_phases() -> dict[str, float]:
    """Patches the ``PHASES``' functions to add their seconds to the dict returned."""
    seconds = dict.fromkeys((label for label, *_ in PHASES), 0.0)
    for label, module_name, owner_name, name in PHASES:
        module = importlib.import_module(module_name)
        owner = getattr(module, owner_name) if owner_name else module
        original = getattr(owner, name)

        def timed(*args, _original=original, _label=label, **kwargs):
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                seconds[_label] += time.perf_counter() - started

        setattr(owner, name, timed)
    return seconds


def _synchronize(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def plain_forward(
    model_dir: Path, dtype: torch.dtype, ids: torch.Tensor, repeats: int, device: str
) -> tuple[float, float]:
    """(first forward after loading, best of the repeats after it). The first one pays what
    extraction's single forward pays too (weights paged in from the mmapped shards)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, device_map=device).eval()
    ids = ids.to(device)
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            _synchronize(device)
            started = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            _synchronize(device)
            times.append(time.perf_counter() - started)
    del model
    return times[0], min(times[1:])


def extraction(
    model_dir: Path, store: Path, seq_len: int, floor: bool, device: str, logits_topk: int = 16
) -> tuple[float, float]:
    """(seconds for the whole extraction without model loading, loading seconds)."""
    session = LayerParitySession(
        settings(
            gpu_golden=True,
            extract=True,
            model=str(model_dir),
            golden_dir=str(store),
            dtype="bfloat16",
            seq_len=seq_len,
            golden_device="cpu" if device == "cpu" else "cuda",
            device_map=device,
            no_precision_floor=not floor,
            logits_topk=logits_topk,
        ),
        ROOT,
    )
    loading = []
    reference = session.reference
    original = reference._load

    def timed(streaming):
        started = time.perf_counter()
        model = original(streaming)
        loading.append(time.perf_counter() - started)
        return model

    reference._load = timed
    started = time.perf_counter()
    for i in session.selected_layers:
        session.extract_layer(i)
    total = time.perf_counter() - started
    return total - sum(loading), sum(loading)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda:0 (the model and the goldens' runs there)")
    parser.add_argument(
        "--ieee-matmul",
        action="store_true",
        help="the wide matmuls of 16-bit operands in IEEE float32 (no TF32, no oneDNN bfloat16 mode)",
    )
    parser.add_argument(
        "--logits-topk", type=int, default=16, help="0: no whole-model golden (per-layer verdicts alone)"
    )
    parser.add_argument(
        "--one-at-a-time", action="store_true", help="each call's perturbed runs one after the other, not as one batch"
    )
    parser.add_argument(
        "--model-runs", type=int, default=None, help="the whole model's perturbed runs (default: the plugin's rule)"
    )
    parser.add_argument(
        "--no-perturbation",
        action="store_true",
        help="the envelopes' runs in the model's own arithmetic (no op rounded anew): what the runs cost at their ops' "
        "own speed, the least this many runs can cost",
    )
    args = parser.parse_args()
    if args.no_perturbation:
        from pytest_layerparity.noise.perturb import PerturbedArithmetic

        PerturbedArithmetic.__torch_dispatch__ = lambda _self, func, _types, args=(), kwargs=None: func(
            *args, **(kwargs or {})
        )
    if args.model_runs is not None:
        from pytest_layerparity.reference import model_golden

        model_golden.model_envelope_samples = lambda _samples: args.model_runs
    if args.one_at_a_time:
        from pytest_layerparity.noise import batching
        from pytest_layerparity.noise import perturbed_runs as envelope
        from pytest_layerparity.reference import plan

        for module in (batching, envelope, plan):
            module.samples_per_forward = lambda *_args, **_kw: 1
    if args.device == "cuda":
        args.device = "cuda:0"
    if args.ieee_matmul:
        import contextlib

        from pytest_layerparity.noise import lowerings, perturb

        perturb.exact_fast_matmul = lambda *_: contextlib.nullcontext()
        lowerings.exact_fast_matmul = perturb.exact_fast_matmul
    from tiny_models import make

    work = work_folder("bench-extract-")
    model = make("llama", work / "model", num_layers=args.layers, shard_size="200MB", **WIDTH)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors")) / 1e9
    ids = torch.randint(0, WIDTH["vocab_size"], (1, args.seq_len), generator=torch.Generator().manual_seed(0))
    bf16_first, bf16 = plain_forward(model, torch.bfloat16, ids, args.repeats, args.device)
    fp32_first, fp32 = plain_forward(model, torch.float32, ids, args.repeats, args.device)
    # The first perturbed op would import torch._dynamo (torch's dispatch modes are wrapped in
    # its disable decorator) if nothing before it has: a one-time cost of the process, whatever
    # the model (seconds where torch's bytecode is not cached), timed beside model loading.
    started = time.perf_counter()
    importlib.import_module("torch._dynamo")
    imports = time.perf_counter() - started
    bare, _ = extraction(model, work / "no-floor", args.seq_len, False, args.device, args.logits_topk)
    phases = time_phases()  # the extraction with the floor's alone
    full, load = extraction(model, work / "floor", args.seq_len, True, args.device, args.logits_topk)
    print(
        f"model: llama, {args.layers} layers, hidden {WIDTH['hidden_size']}, {size:.2f} GB bf16; seq {args.seq_len}; "
        f"{torch.get_num_threads()} threads; {args.device}"
        + (f" ({torch.cuda.get_device_name(0)})" if args.device != "cpu" else "")
        + (", wide matmuls in IEEE float32" if args.ieee_matmul else "")
        + (", no whole-model golden" if args.logits_topk == 0 else "")
        + (", perturbed runs one at a time" if args.one_at_a_time else "")
        + (f", {args.model_runs} whole-model runs" if args.model_runs is not None else "")
        + (", runs not perturbed" if args.no_perturbation else "")
    )
    print(f"{'what':<58} {'seconds':>8} {'ratio':>7}")
    print(f"{f'plain forward, bf16: first after loading / best of {args.repeats}':<58} {bf16_first:>8.2f} {bf16:>6.2f}")
    print(
        f"{f'plain forward, float32: first after loading / best of {args.repeats}':<58} {fp32_first:>8.2f} {fp32:>6.2f}"
    )
    print(
        f"{'extraction, no precision floor (forward+capture+writes)':<58} {bare:>8.2f} "
        f"{bare / bf16_first:>6.2f}x of the first bf16 forward, {bare / bf16:.2f}x of the best"
    )
    print(
        f"{'extraction with the float32 precision floor':<58} {full:>8.2f} "
        f"{full / (bf16_first + fp32_first):>6.2f}x of the first bf16 + float32 forwards, {full / (bf16 + fp32):.2f}x "
        "of the best"
    )
    print(
        f"{'  the same against one plain bf16 forward':<58} {'':>8} "
        f"{full / bf16_first:>6.2f}x of the first, {full / bf16:.2f}x of the best"
    )
    plain = bf16_first + fp32_first
    for label, seconds in [*phases.items(), ("the rest (capture, writes)", full - sum(phases.values()))]:
        print(f"{f'  {label}':<58} {seconds:>8.2f} {seconds / plain:>6.2f}x of the first bf16 + float32 forwards")
    print(f"{'(model loading, left out of the ratios)':<58} {load:>8.2f}")
    print(f"{'(one-time import of torch._dynamo, left out of the ratios)':<58} {imports:>8.2f}")


if __name__ == "__main__":
    main()
