"""``--plan`` against the real extraction: predicted vs measured peak memory.

    PJRT_DEVICE=CPU python bench/bench_plan.py [--work DIR] [--seq-lens 128,512,2048]
        [--model-type minimax_m2|qwen3_moe|mixtral|llama] [--envelope-samples K]

1. Generates a checkpoint of about 1 GB, 16 layers (bf16, sharded): MiniMax-M2-shaped by
   default (the calibration model of the plan), or another architecture (evaluation).
2. For each sequence length and each set of options, prints the tensors ``pytest --plan``
   says ``--device-map stream`` extraction allocates, and what the extraction really
   allocated: the peak of its anonymous resident memory (``RssAnon``: what the process
   allocated, without the file-backed pages of the libraries' code and of mapped files,
   which the kernel takes back when it needs them) above the state once the model's code is
   imported and its weightless skeleton built, sampled every 0.5 ms in the extracting
   process, with their ratio; the whole process's peak RSS (file-backed pages included)
   against the plan's total (tensors + the code it measured) + the RSS of ``import torch,
   transformers``; and the measured peak against the bound extraction keeps to: twice the
   largest layer in the run's dtype plus one layer's activations (``bound``). Extraction
   runs ``--layers 0-3`` of 16 (the run holds one layer's call at a time: flat in depth).
   ``planned`` is the plan's tensors and the run's own overhead beside them
   (``plan.RUN_OVERHEAD``).
3. The same run on a miniature of the architecture (``MINIATURE``: hidden size 64, the rest
   kept): what it allocates beyond its plan's tensors is the run's fixed part (``fixed``),
   what ``plan.RUN_OVERHEAD`` stands for (measured on MiniMax-M2's miniature at seq 128).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_streaming import measure, pytest_args

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "fixtures"))
from scratch import work_folder

#: The checkpoints: MiniMax-M2's shape is the one the plan was built against (calibration);
#: Qwen3-MoE and Llama were run while it was built (what they showed is in bench/README.md);
#: Mixtral only once the plan was final (evaluation); OLMoE never before the plan counted the
#: run's overhead and the experts' end (held out).
MODELS = {
    "minimax_m2": {
        "hidden_size": 1024,
        "intermediate_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rotary_dim": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "max_position_embeddings": 8192,
    },
    "qwen3_moe": {
        "hidden_size": 768,
        "intermediate_size": 2048,
        "moe_intermediate_size": 768,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "vocab_size": 48000,
        "max_position_embeddings": 8192,
    },
    "mixtral": {
        "hidden_size": 1024,
        "intermediate_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "max_position_embeddings": 8192,
    },
    "olmoe": {  # held out: first run with the plan's overhead and experts' end final
        "hidden_size": 1024,
        "intermediate_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,  # its q and k norms span the hidden size
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "max_position_embeddings": 8192,
    },
    "llama": {
        "hidden_size": 1536,
        "intermediate_size": 4096,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "vocab_size": 40000,
        "max_position_embeddings": 8192,
    },
}
VARIANTS = {
    "default": [],
    "no floor": ["--no-precision-floor", "--envelope-samples", "0"],
    "float32": ["--dtype", "float32"],
}


#: A miniature of each architecture: the same config with these widths (the vocabulary, depth,
#: experts and options kept), its layers about 1/300 of the checkpoint's. What its run holds
#: beyond its plan's tensors is the part of a run that does not scale with the weights (the
#: allocator's free lists, Python objects, kernels' caches): measured beside each row.
MINIATURE = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rotary_dim": 8,
}


def checkpoint(work: Path, kind: str, miniature: bool = False) -> Path:
    from tiny_models import make

    out = work / f"{kind}-16{'-mini' if miniature else ''}"
    if not (out / "config.json").exists():
        config = dict(MODELS[kind])
        if miniature:
            config.update({k: v for k, v in MINIATURE.items() if k in config})
        make(kind, out, num_layers=16, shard_size="200MB", **config)
    return out


def _gb(text: str) -> float:
    value, unit = text.split()
    return float(value) / (1 if unit == "GB" else 1000)


def planned(model: Path, seq: int, extra: list[str], work: Path) -> tuple[float, float, float]:
    """What ``pytest --plan`` says streaming extraction needs (GB): its tensors, the run's own
    overhead beside them, and in all."""
    proc = subprocess.run(
        [*pytest_args("--plan", f"--model={model}", "--seq-len", str(seq), *extra)],
        cwd=work,
        capture_output=True,
        text=True,
        check=False,
    )
    total = re.search(r"--device-map stream on \S+: needs ([\d.]+ [GM]B)", proc.stdout)
    tensors = re.search(r"tensors the run allocates[^:]*: ([\d.]+ [GM]B)", proc.stdout)
    overhead = re.search(r"beside them, the run's own[^:]*: ([\d.]+ [GM]B)", proc.stdout)
    if not total or not tensors or not overhead:
        raise SystemExit(f"no stream lines in --plan output:\n{proc.stdout}\n{proc.stderr}")
    return _gb(tensors.group(1)), _gb(overhead.group(1)), _gb(total.group(1))


PROBE = """
import os, sys, threading, time
import pytest
from pytest_layerparity.reference import extract

page = os.sysconf("SC_PAGE_SIZE")
def rss():  # (resident, anonymous resident): statm's resident less its file-backed and shared
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return int(fields[1]) * page, (int(fields[1]) - int(fields[2])) * page
state = {"peak": (0, 0), "ready": None, "stop": False}
def sample():
    while not state["stop"]:
        now = rss()
        state["peak"] = (max(state["peak"][0], now[0]), max(state["peak"][1], now[1]))
        time.sleep(0.0005)
load = extract.ReferenceSide._load
def probed(self, streaming):
    model = load(self, streaming)
    state["ready"] = rss()
    state["peak"] = state["ready"]
    return model
extract.ReferenceSide._load = probed
threading.Thread(target=sample, daemon=True).start()
code = pytest.main(sys.argv[1:])
state["stop"] = True
time.sleep(0.01)
print("PROBE", code, *state["ready"], *state["peak"])
"""


def probe(args: list[str], work: Path) -> tuple[float, float, float]:
    """(peak anonymous RSS above the state once the skeleton is built, the same for all of
    RSS, whole-process peak RSS), GB."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *args],
        cwd=work,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PJRT_DEVICE": "CPU"},
    )
    found = re.search(r"PROBE (\d+) (\d+) (\d+) (\d+) (\d+)", proc.stdout)
    if not found or found.group(1) != "0":
        raise SystemExit(f"failed: {args}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    ready, ready_anon, peak, peak_anon = (int(found.group(i)) for i in range(2, 6))
    return (peak_anon - ready_anon) / 1e9, (peak - ready) / 1e9, peak / 1e9


def bound(model: Path, seq: int, extra: list[str]) -> float:
    """Twice the largest layer in the run's dtype plus one layer's activations (GB)."""
    from pytest_layerparity.model.source import ModelSource
    from pytest_layerparity.reference.plan import layer_activations, make_plan

    dtype = extra[extra.index("--dtype") + 1] if "--dtype" in extra else "bfloat16"
    source = ModelSource(model)
    plan = make_plan(source, dtype, 1, seq)
    size = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    return (2 * plan.largest_layer[1] + layer_activations(source.config_json, 1, seq, size, False)) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--seq-lens", default="128,512,2048")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--model-type", choices=sorted(MODELS), default="minimax_m2")
    parser.add_argument(
        "--envelope-samples", type=int, default=2, help="perturbed runs per layer (the plugin's default is 12)"
    )
    opts = parser.parse_args()
    work = work_folder("bench-plan-", opts.work)
    model = checkpoint(work, opts.model_type)
    miniature = checkpoint(work, opts.model_type, miniature=True)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors")) / 1e9
    floor, _ = measure([sys.executable, "-c", "import torch, transformers"], work)
    print(
        f"checkpoint: {model} ({opts.model_type}, {size:.2f} GB bf16, 16 layers); "
        f"import torch + transformers: {floor:.3f} GB; K={opts.envelope_samples}"
    )
    print(
        f"{'options':<10} {'seq':>5} {'tensors':>8} {'planned':>8} {'anon':>6} {'ratio':>6} {'all RSS':>8}   "
        f"{'plan+floor':>10} {'process':>8} {'ratio':>6}   {'bound':>6} {'anon/bound':>10}   "
        f"{'fixed':>6}  (GB; planned: the tensors and the run's own overhead; then the whole process)"
    )
    for variant in opts.variants.split(","):
        extra = VARIANTS[variant]
        for seq in (int(s) for s in opts.seq_lens.split(",")):
            common = [f"--model={model}", "--device-map", "stream", "--seq-len", str(seq), *extra]
            store = work / f"golden-{variant.replace(' ', '-')}-{seq}"
            args = ["--gpu-golden", "--extract", f"--golden-dir={store}", "--force-regen", "--layers", "0-3"]
            if "--envelope-samples" not in extra:
                args += ["--envelope-samples", str(opts.envelope_samples)]
            anon, resident, process = probe([*args, *common], work)
            tensors, overhead, total = planned(model, seq, extra, work)
            limit = bound(model, seq, extra)
            small = [f"--model={miniature}", *common[1:]]
            fixed = probe([*args, *small], work)[0] - planned(miniature, seq, extra, work)[0]
            plan = tensors + overhead
            print(
                f"{variant:<10} {seq:>5} {tensors:>8.3f} {plan:>8.3f} {anon:>6.3f} {anon / plan:>6.2f} "
                f"{resident:>8.3f}   {total + floor:>10.3f} {process:>8.3f} {process / (total + floor):>6.2f}   "
                f"{limit:>6.3f} {anon / limit:>10.2f}   {fixed:>6.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
