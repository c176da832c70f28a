"""How torch-xla's CPU kernels round, op by op, against eager and the exact result: what the
noise envelope's perturbation model has to cover for a correct port on that backend.

    PJRT_DEVICE=CPU python bench/bench_xla_kernels.py [--gelu-forms | --dot-sizes | --one-row] [--device cuda]

For each op and 16-bit dtype, on one random input (64 x 4096, N(0, 2)), against the op
computed in float64 on the same 16-bit input:

* ``noise_ratio``: ||result - exact|| / ||round(exact) - exact||, 1 for a correctly rounded
  kernel (the perturbation's 16-bit results are within about 1.2 of it);
* ``lean``: the error's component along the result itself, (result - exact) . r / ||r||,
  over ||round(exact) - exact|| (the rounding noise's norm): the part of the error that
  scales the whole result one way. Random rounding errors give a lean of order 1/sqrt(N)
  (0.002 here) whatever the dtype; eager's correctly rounded results read more where many
  elements share a value (the input is 16-bit: equal inputs round equally). What a backend
  adds beyond eager's lean is a kernel that leans (a reduction summed in 16-bit that
  stagnates, a low-precision transcendental), which the layer's contribution_bias sees.

``--gelu-forms``: how far each GELU kernel's error lies along GELU's other form, as a share
of the swap (erf where the model has tanh, or the other way: the error regressed on the two
forms' difference), eager and torch-xla, per dtype: a port that swaps the forms reads 1, a
kernel that leans by rounding alone reads what it reads here.

``--dot-sizes``: the float16 matmul alone over shapes m x k @ k x n, its error against the
exact product over eager's (eager sums in float32 and rounds once): where torch-xla's CPU
backend sums the products in float16 (a ratio near 12) and where in float32 (1).

``--one-row``: a float32 decode step's one-row linear (1 x k times a weight), with and without
a bias, eager's and the device's error against the exact product over eager's without a bias,
beside a sum of the products in order from the bias, one fused multiply-add at a time (what the
perturbed runs' ``lowerings.SEQUENTIAL_SUMS`` alternative computes, ``sums.fused_sequential_sum``),
and the share of the device's results with a bias equal to that sum's bit for bit; and a decode
step's attention scores (one query a head times the keys), the device's and an in-order sum's
error over eager's.

``--device cuda``: CUDA's kernels in torch-xla's place (the same tables; on a lent GPU
machine, where torch-xla is not installed).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch
import torch.nn.functional as F

from pytest_layerparity.noise.sums import fused_sequential_sum

OPS = {
    "gelu (erf)": lambda t, w: F.gelu(t),
    "gelu (tanh)": lambda t, w: F.gelu(t, approximate="tanh"),
    "silu": lambda t, w: F.silu(t),
    "exp": lambda t, w: torch.exp(t.clamp(max=8)),
    "rsqrt": lambda t, w: torch.rsqrt(t.abs() + 0.1),
    "softmax": lambda t, w: torch.softmax(t, -1),
    "layer_norm": lambda t, w: F.layer_norm(t, (t.shape[-1],)),
    "row sum": lambda t, w: t.sum(-1, keepdim=True),
    "matmul": lambda t, w: t @ w,
}


def dot_ratio(device: torch.device, generator: torch.Generator, *shape: int) -> float:
    """A float16 product of random operands (``shape``: m, k, n, or batch, m, k, n) on
    ``device``: its error against the exact product over eager's."""
    *lead, m, k, n = shape
    a = torch.randn(*lead, m, k, generator=generator).half()
    b = (torch.randn(*lead, k, n, generator=generator) / k**0.5).half()
    exact = a.double() @ b.double()
    xla = (a.to(device) @ b.to(device)).cpu().double()
    return float((xla - exact).norm() / ((a @ b).double() - exact).norm())


def dot_sizes(device: torch.device) -> None:
    """The float16 dot's error over eager's, by shape (rows m of the table, k x n its columns)."""
    g = torch.Generator().manual_seed(2)
    shapes = [(k, n) for k in (64, 256, 512, 1024, 2048) for n in (64, 256)]
    print("float16 m x k @ k x n: ||xla - exact|| / ||eager - exact||")
    print(f"{'m':>4} " + " ".join(f"{f'k{k} n{n}':>11}" for k, n in shapes))
    for m in (1, 8, 16, 32, 64):
        print(f"{m:>4} " + " ".join(f"{dot_ratio(device, g, m, k, n):>11.1f}" for k, n in shapes))
    print("at a real model's width (a decode step's one-row products; 32 heads' scores times values):")
    for batch, m, k, n in ((1, 1, 4096, 14336), (1, 1, 14336, 4096), (1, 2, 4096, 4096), (32, 1, 2048, 128)):
        print(f"  {batch} x ({m} x {k} @ {k} x {n}): {dot_ratio(device, g, batch, m, k, n):.1f}")


def one_row(device: torch.device) -> None:
    """A float32 one-row linear's error, with and without a bias, eager and ``device``, and a sum
    of its products in order from the bias, over eager's without a bias (random operands)."""
    g = torch.Generator().manual_seed(4)
    print("float32 1 x k linear: ||result - exact|| / ||eager (no bias) - exact||")
    columns = ("eager", "eager+bias", "device", "device+bias", "in order+bias", "same as FMAs")
    print(f"{'k':>5} {'n':>5} " + " ".join(f"{c:>13}" for c in columns))
    for k, n in ((64, 896), (640, 2048), (896, 128), (896, 4864), (2048, 640), (4096, 1024), (4864, 896)):
        x, w, b = torch.randn(1, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        exact = x.double() @ w.double().T
        results = (
            (F.linear(x, w), exact),
            (F.linear(x, w, b), exact + b.double()),
            (F.linear(x.to(device), w.to(device)).cpu(), exact),
            (F.linear(x.to(device), w.to(device), b.to(device)).cpu(), exact + b.double()),
            (fused_sequential_sum(x, w.T, b), exact + b.double()),
        )
        errors = [float((r.double() - e).norm() / e.norm()) for r, e in results]
        same = float((results[3][0] == results[4][0]).double().mean())  # bit for bit
        print(f"{k:>5} {n:>5} " + " ".join(f"{e / errors[0]:>13.2f}" for e in errors) + f" {same:>13.1%}")
    print("a decode step's attention scores, one query a head times the keys: ||result - exact|| / eager's")
    print(f"{'heads':>5} {'head':>5} {'keys':>5} {'device':>13} {'in order':>13}")
    for heads, head, keys in ((4, 64, 33), (14, 64, 33), (4, 256, 601), (8, 128, 600)):
        q, key = torch.randn(1, heads, 1, head, generator=g), torch.randn(1, heads, keys, head, generator=g)
        exact = q.double() @ key.double().transpose(-1, -2)
        eager = float(((q @ key.transpose(-1, -2)).double() - exact).norm())
        device_error = float(((q.to(device) @ key.to(device).transpose(-1, -2)).cpu().double() - exact).norm())
        ordered = float((fused_sequential_sum(q, key.transpose(-1, -2)).double() - exact).norm())
        print(f"{heads:>5} {head:>5} {keys:>5} {device_error / eager:>13.2f} {ordered / eager:>13.2f}")


def gelu_forms(device: torch.device) -> None:
    """Each GELU kernel's error along the swap of GELU's forms, as a share of the swap, on
    inputs N(0, scale^2) of several scales; and the device's share beyond eager's (eager
    rounds a float32 result once: a correctly rounded kernel), what ``verdict.KERNEL_LEAN``
    allows a correct kernel."""
    base = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3))
    print("GELU: the error's share of the swap to the other form (a swapped port reads 1)")
    print(
        f"{'dtype':<9} {'form':<5} {'scale':>5} {'|swap| / |rounding|':>19} {'eager share':>11} "
        f"{'device share':>12} {'device - eager':>14}"
    )
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        largest = 0.0
        for form, other in (("none", "tanh"), ("tanh", "none")):
            for scale in (0.5, 1.0, 2.0, 4.0):
                xd = (base * scale).to(dtype)
                exact = F.gelu(xd.double(), approximate=form)
                swap = F.gelu(xd.double(), approximate=other) - exact
                rounding = float((exact.to(dtype).double() - exact).norm())
                shares = [
                    float((result.double() - exact) @ swap) / float(swap @ swap)
                    for result in (F.gelu(xd, approximate=form), F.gelu(xd.to(device), approximate=form).cpu())
                ]
                largest = max(largest, abs(shares[1] - shares[0]))
                name = str(dtype).removeprefix("torch.")
                print(
                    f"{name:<9} {form:<5} {scale:>5g} {float(swap.norm()) / rounding:>19.3f} "
                    f"{shares[0]:>+11.3f} {shares[1]:>+12.3f} {shares[1] - shares[0]:>+14.3f}"
                )
        print(f"{str(dtype).removeprefix('torch.'):<9} the largest |device - eager|: {largest:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    instead = parser.add_mutually_exclusive_group()
    instead.add_argument("--dot-sizes", action="store_true", help="the float16 dot's error by shape instead")
    instead.add_argument("--gelu-forms", action="store_true", help="GELU's error along its other form instead")
    instead.add_argument("--one-row", action="store_true", help="the float32 one-row linear's error instead")
    parser.add_argument("--device", choices=("xla", "cuda"), default="xla", help="whose kernels (default: torch-xla)")
    args = parser.parse_args()
    if args.device == "cuda":
        device = torch.device("cuda")
    else:
        import torch_xla

        device = torch_xla.device()
    chosen = {"dot_sizes": dot_sizes, "gelu_forms": gelu_forms, "one_row": one_row}
    for flag, table in chosen.items():
        if getattr(args, flag):
            table(device)
            return
    x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0)) * 2
    w = torch.randn(4096, 512, generator=torch.Generator().manual_seed(1)) / 64
    print(f"{'dtype':<9} {'op':<12} {'eager ratio':>11} {'device ratio':>12} {'eager lean':>11} {'device lean':>11}")
    for dtype in (torch.bfloat16, torch.float16):
        xd, wd = x.to(dtype), w.to(dtype)
        for name, op in OPS.items():
            exact = op(xd.double(), wd.double())
            noise = float((exact.to(dtype).double() - exact).norm())
            direction = exact / exact.norm()
            read = []
            for result in (op(xd, wd), op(xd.to(device), wd.to(device)).cpu()):
                error = result.double() - exact
                read.append((float(error.norm()) / noise, float((error * direction).sum()) / noise))
            (eager_ratio, eager_lean), (ratio, lean) = read
            print(
                f"{str(dtype).removeprefix('torch.'):<9} {name:<12} {eager_ratio:>11.3f} {ratio:>12.3f} "
                f"{eager_lean:>+11.3f} {lean:>+11.3f}"
            )


if __name__ == "__main__":
    main()
