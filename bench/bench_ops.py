"""Overhead of NanInfTracker and CompareWithCPU on one transformer decoder layer.

Builds a small Llama decoder layer from transformers (hidden 256, 8 heads,
4 KV heads, MLP 1024, seq 64), runs its forward in fp32 and bf16 on the CPU,
in the same process, and prints the median time per forward of

* the plain run,
* a do-nothing TorchDispatchMode (the floor of any per-op Python tool),
* NanInfTracker,
* CompareWithCPU (on the CPU: device op == CPU op, so this is the cost of
  the second run plus the comparisons),

each as a ratio to the plain run (tracked time / plain time).  Runs are
interleaved (plain, floor, tracker, ... per repeat) so that load from other
processes hits all variants alike, and each ratio is the median over the
repeats of (variant time / plain time within the same repeat).  With ``--xla`` it also times one forward
under CompareWithCPU and NanInfTracker on the torch-xla device
(PJRT_DEVICE=CPU): every compared op is materialised, one graph execution per
op, so that is slow by design.

    PJRT_DEVICE=CPU python bench/bench_ops.py [--batch 1] [--repeats 30] [--xla]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pytest_layerparity.ops import CompareWithCPU, ModuleInfo, NanInfTracker, open_module_tracker


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def build_layer(dtype, batch, seq=64, hidden=256, attn="sdpa", device="cpu"):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=1,
        max_position_embeddings=2 * seq,
    )
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, 0).eval().to(dtype)
    x = torch.randn(batch, seq, hidden).to(dtype)
    pos = torch.arange(seq)[None].expand(batch, seq)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, pos)
    mask = None
    if attn == "eager":  # additive causal mask with finfo.min (as transformers builds it)
        mask = torch.full((seq, seq), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]
        mask = mask.expand(batch, 1, seq, seq)
    layer = layer.to(device)
    args = {
        "hidden_states": x.to(device),
        "attention_mask": None if mask is None else mask.to(device),
        "position_ids": pos.to(device),
        "position_embeddings": (cos.to(device), sin.to(device)),
    }
    return layer, args


def forward(layer, args):
    with torch.no_grad():
        out = layer(**args)
    return out[0] if isinstance(out, tuple) else out


def bench_cpu(dtype, batch, repeats, attn, inner=5):
    layer, args = build_layer(dtype, batch, attn=attn)
    handle = open_module_tracker(layer)

    variants = {
        "plain": lambda: forward(layer, args),
        "dispatch-mode floor": lambda: _with(_PassThrough(), layer, args),
        "NanInfTracker": lambda: _with(NanInfTracker(), layer, args),
        "CompareWithCPU": lambda: _with(CompareWithCPU(), layer, args),
    }
    times = {k: [] for k in variants}
    for _ in range(3):  # warm-up
        for f in variants.values():
            f()
    for _ in range(repeats):
        for k, f in variants.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                f()
            times[k].append((time.perf_counter() - t0) / inner)
    handle.remove()
    # sanity: the tools found nothing on a clean layer
    with NanInfTracker() as nan, CompareWithCPU() as cmp:
        forward(layer, args)
    assert not nan.failures and not cmp.failures, (nan.failures[:1], cmp.failures[:1])
    n_ops = nan.stats["checked"] + nan.stats["white_listed"]
    plain = times["plain"]
    # ratio per repeat (each variant against the plain run of the same repeat,
    # which cancels slow drifts of the machine's load), then the median
    ratios = {k: statistics.median(t / p for t, p in zip(v, plain, strict=False)) for k, v in times.items()}
    return statistics.median(plain), min(plain), ratios, n_ops


def _with(mode, layer, args):
    with mode:
        return forward(layer, args)


def bench_xla(dtype, batch):
    import torch_xla

    dev = torch_xla.device()
    layer, args = build_layer(dtype, batch, device=dev, attn="eager")
    open_module_tracker(layer)
    res = {}

    def plain():
        out = forward(layer, args)
        torch_xla.sync()
        out.cpu()

    for name, mk in [
        ("plain (lazy, one graph)", None),
        ("NanInfTracker (deferred)", NanInfTracker),
        ("CompareWithCPU", CompareWithCPU),
    ]:
        runs = []
        for _ in range(2):  # first run compiles, second hits the graph cache
            t0 = time.perf_counter()
            if mk is None:
                plain()
            else:
                with mk() as tool:
                    out = forward(layer, args)
                torch_xla.sync()
                out.cpu()
                assert not tool.failures, tool.failures[:1]
                if isinstance(tool, CompareWithCPU):
                    compared = tool.stats["checked"]
            runs.append(time.perf_counter() - t0)
        res[name] = runs
    ModuleInfo.reset()
    res["ops compared (one graph execution each)"] = compared
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1 keeps timings stable on a shared machine)"
    )
    p.add_argument("--xla", action="store_true", help="also time one layer on the torch-xla device")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"cpus {os.cpu_count()}, attention {a.attn}, repeats {a.repeats}"
    )
    print(
        f"{'dtype':9} {'batch':>5} {'ops':>4} {'plain ms':>9} {'(best)':>7} {'floor':>7} {'NanInf':>7} {'Compare':>8}"
    )
    for batch in a.batch:
        for dtype in (torch.float32, torch.bfloat16):
            med, best, r, n_ops = bench_cpu(dtype, batch, a.repeats, a.attn)
            print(
                f"{str(dtype).replace('torch.', ''):9} {batch:>5} {n_ops:>4} {med * 1e3:>9.2f} "
                f"{best * 1e3:>7.2f} {r['dispatch-mode floor']:>6.2f}x {r['NanInfTracker']:>6.2f}x "
                f"{r['CompareWithCPU']:>7.2f}x"
            )
    print(
        "(plain ms: median (and best) time of one forward; ratios: tracked / plain time, the median\n"
        " over the repeats of the ratio within each repeat; 'floor' = an empty TorchDispatchMode;\n"
        " 'ops' = aten ops per forward)"
    )
    if a.xla:
        res = bench_xla(torch.float32, 1)
        print(
            "\ntorch-xla (PJRT_DEVICE=CPU), fp32, batch 1, eager attention, one forward "
            "[first run (compiles), second run]:"
        )
        for k, v in res.items():
            if isinstance(v, list):
                print(f"  {k:28} " + ", ".join(f"{t * 1e3:9.1f} ms" for t in v))
            else:
                print(f"  {k:28} {v}")


if __name__ == "__main__":
    main()
