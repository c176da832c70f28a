"""Memory and time of golden extraction, layer streaming against whole-model loading, and of a
single-layer parity test as the model gets deeper.

    PJRT_DEVICE=CPU python bench/bench_streaming.py [--work DIR]

1. Generates a llama-shaped checkpoint of about 0.9 GB with 16 layers (bf16, sharded).
2. Prints peak RSS (``/usr/bin/time -v``) and wall time of: importing torch + transformers
   (the floor), extraction with ``--device-map stream``, and with ``--device-map cpu``
   (the whole model through from_pretrained).
3. Generates checkpoints of equal width with 8 and 32 layers and times ``-k layer_N`` on
   the CPU target against each (peak RSS and wall time).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "fixtures"))
from scratch import work_folder

WIDTH = {
    "hidden_size": 1024,
    "intermediate_size": 5632,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 32000,
}


def measure(args: list[str], cwd: Path) -> tuple[float, float]:
    """(peak RSS in GB, wall seconds) of a command run under /usr/bin/time -v."""
    started = time.perf_counter()
    proc = subprocess.run(
        ["/usr/bin/time", "-v", *args],
        cwd=cwd,
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, "PJRT_DEVICE": "CPU"},
    )
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(args)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    return rss_kb / 1e6, wall


def checkpoint(work: Path, layers: int) -> Path:
    from tiny_models import make

    out = work / f"llama-{layers}"
    if not (out / "config.json").exists():
        make("llama", out, num_layers=layers, shard_size="200MB", **WIDTH)
    return out


def pytest_args(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *args]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--seq-len", default="128")
    opts = parser.parse_args()
    work = work_folder("bench-streaming-", opts.work)
    model16 = checkpoint(work, 16)
    size = sum(p.stat().st_size for p in model16.glob("*.safetensors")) / 1e9
    layer = sum(p.stat().st_size for p in model16.glob("*.safetensors"))  # refined below
    from pytest_layerparity.model.checkpoint import Checkpoint
    from pytest_layerparity.reference.plan import checkpoint_sizes

    ck = Checkpoint.open(model16)
    numel = checkpoint_sizes(ck).numel
    layer = sum(numel[k] for k in ck.layer_keys("model.layers", 0)) * 2 / 1e9
    print(f"checkpoint: {model16} ({size:.2f} GB bf16, 16 layers, largest layer {layer:.3f} GB), seq {opts.seq_len}")
    floor, floor_t = measure([sys.executable, "-c", "import torch, transformers"], work)
    print(f"{'run':<44} {'peak RSS GB':>12} {'above floor':>12} {'wall s':>8}")
    print(f"{'import torch + transformers':<44} {floor:>12.3f} {'':>12} {floor_t:>8.1f}")
    base, _ = measure(
        pytest_args(
            "--gpu-golden",
            "--extract",
            f"--model={model16}",
            f"--golden-dir={work / 'co'}",
            "--dtype",
            "bfloat16",
            "--co",
        ),
        work,
    )
    print(f"{'pytest --gpu-golden --extract --co (imports)':<44} {base:>12.3f} {base - floor:>12.3f}")
    runs = [
        ("stream", [], "extract, --device-map stream"),
        ("stream-nofloor", ["--no-precision-floor"], "extract, stream, --no-precision-floor"),
        ("cpu", [], "extract, whole model (--device-map cpu)"),
    ]
    for name, extra, label in runs:
        store = work / f"golden-{name}"
        mode = name.split("-")[0]
        rss, wall = measure(
            pytest_args(
                "--gpu-golden",
                "--extract",
                f"--model={model16}",
                f"--golden-dir={store}",
                "--dtype",
                "bfloat16",
                "--device-map",
                mode,
                "--seq-len",
                opts.seq_len,
                *extra,
            ),
            work,
        )
        print(f"{label:<44} {rss:>12.3f} {rss - floor:>12.3f} {wall:>8.1f}", flush=True)
    same = all(
        (work / "golden-stream" / p.name).read_bytes() == p.read_bytes()
        for p in (work / "golden-cpu").glob("*.safetensors")
    )
    print(f"streaming goldens equal whole-model goldens bit for bit: {same}")
    print()
    print(f"{'single-layer parity test (-k layer_3)':<44} {'peak RSS GB':>12} {'wall s':>8}")
    for depth in (8, 32):
        model = checkpoint(work, depth)
        store = work / f"golden-{depth}"
        measure(
            pytest_args(
                "--gpu-golden",
                "--extract",
                f"--model={model}",
                f"--golden-dir={store}",
                "--dtype",
                "bfloat16",
                "--device-map",
                "stream",
                "--layers",
                "3",
                "--seq-len",
                opts.seq_len,
            ),
            work,
        )
        rss, wall = measure(
            pytest_args(
                "--target", "cpu", f"--model={model}", f"--golden-dir={store}", "--layers", "3", "-k", "layer_3"
            ),
            work,
        )
        print(f"{f'{depth} layers':<44} {rss:>12.3f} {wall:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
