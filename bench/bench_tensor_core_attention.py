"""How far a float32 attention kernel leans against the exact attention, per kernel: the
lean (the mean of each output's error times its sign, in float32 ulps of the largest output;
negative: toward zero), the median of each output's move toward zero in ulps of its own, and
the error's size (its root mean square, in ulps of the largest output), for the CPU's flash
kernel, the math attention in float32, what half the perturbed runs take
(noise/tensor_cores.py's ``leaned`` by each query's keys, from the exact attention; a
query of too few keys to lean rounded to nearest) and, where CUDA is there,
CUDA's memory-efficient and math kernels.

    python bench/bench_tensor_core_attention.py [--shapes 4x32x16,16x512x64,8x2048x128,4x1:33x16,8x1:2048x128]

Each shape is heads x tokens x head_dim, causal, one batch (tokens as queries:keys: a decode
step's queries over a longer past, every key seen), query/key/value drawn from N(0, 1),
values shifted by +0.5 so that outputs lean one way (a row's mean value), seed 0.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pytest_layerparity.noise.tensor_cores import float32_ulp, lean_ulps, leaned


def measure(out: torch.Tensor, exact: torch.Tensor) -> tuple[float, float, float]:
    ulp = torch.finfo(torch.float32).eps * exact.abs().max().item()
    error = out.double().cpu() - exact
    own = ((exact.abs() - out.double().cpu().abs()) / float32_ulp(exact)).median().item()
    return (error * exact.sign()).mean().item() / ulp, own, error.pow(2).mean().sqrt().item() / ulp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="4x32x16,16x512x64,8x2048x128,4x1:33x16,8x1:2048x128")
    args = parser.parse_args()
    print(f"{'heads x tokens x head_dim':<26} {'kernel':<34} {'lean (ulp)':>11} {'own ulps':>9} {'rms (ulp)':>10}")
    for shape in args.shapes.split(","):
        heads, tokens, dim = shape.split("x")
        queries, keys = (int(n) for n in tokens.split(":")) if ":" in tokens else (int(tokens), int(tokens))
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, int(heads), queries, int(dim), generator=g)
        k, v = (torch.randn(1, int(heads), keys, int(dim), generator=g) for _ in range(2))
        v += 0.5
        causal = queries == keys  # a decode step (fewer queries): every key seen
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
        seen = torch.arange(1, queries + 1).clamp_max(keys) if causal else torch.full((queries,), keys)
        lean = lean_ulps(seen)[:, None]  # each query's, by the keys it sees
        model = torch.where(lean > 0, leaned(exact, torch.Generator().manual_seed(0), lean), exact.float())
        outputs = [*kernels(q, k, v, causal), ("perturbed runs' lean (model)", model)]
        for name, out in outputs:
            lean, own, rms = measure(out, exact)
            print(f"{shape:<26} {name:<34} {lean:>11.3f} {own:>9.2f} {rms:>10.3f}")


def kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(kernel, its attention of q, k, v), one after the other."""
    yield "cpu flash", F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    yield "cpu math", torch.ops.aten._scaled_dot_product_attention_math(q, k, v, None, 0.0, causal)[0]
    if not torch.cuda.is_available():
        return
    q, k, v = (t.cuda() for t in (q, k, v))
    for name, backend in (("cuda memory-efficient", SDPBackend.EFFICIENT_ATTENTION), ("cuda math", SDPBackend.MATH)):
        with sdpa_kernel([backend]):
            yield name, F.scaled_dot_product_attention(q, k, v, is_causal=causal)


if __name__ == "__main__":
    main()
