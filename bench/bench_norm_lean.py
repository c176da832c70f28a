"""How far torch-xla's float16 LayerNorm scales its rows beyond what the noise envelope's
float16 layer norm (``layer_norm_in_own_dtype``, no perturbation) gives: the range of
``OWN_DTYPE_NORM_LEAN``.

    PJRT_DEVICE=CPU python bench/bench_norm_lean.py [--widths 64,512,1024] [--rows 2048]
    PJRT_DEVICE=CPU python bench/bench_norm_lean.py --bert 768   # a generated BERT's own rows

For each width and row mean (0, 0.5 and 2 times the spread), random N(mean, 1) rows in
float16: each row's scale error against the exact norm (float64 on the same float16 rows),
(out - exact) . exact / ||exact||^2 in float16 units of 2^-11, averaged over the rows (a
call's lean: what one factor for all its rows models), for torch-xla and for the envelope's
float16 statistics; and what the first leans beyond the second. Widths that are not a power
of two matter: XLA multiplies the sums by 1/width rounded to float16, not exact there.
``--bert WIDTH``: instead, the rows that reach the two LayerNorms of layer 3 of
bench_verdicts' generated BERT of that width (float16, 128 random tokens), as they are and
each row shuffled (the same values in another order).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch

from pytest_layerparity.noise.algorithms import layer_norm_in_own_dtype

UNIT = 2.0**-11


def row_lean(out: torch.Tensor, exact: torch.Tensor) -> float:
    """The rows' mean scale error in float16 units."""
    d = out.double() - exact
    return float(((d * exact).sum(-1) / (exact * exact).sum(-1)).mean()) / UNIT


def leans(x: torch.Tensor, eps: float = 1e-5) -> tuple[float, float]:
    """torch-xla's float16 LayerNorm of the rows ``x`` and the envelope's float16 statistics:
    each one's lean against the exact norm."""
    import torch_xla

    device = torch_xla.device()
    width = x.shape[-1]
    ones, zeros = torch.ones(width, dtype=torch.float16), torch.zeros(width, dtype=torch.float16)
    exact = torch.nn.functional.layer_norm(x.double(), (width,), eps=eps)
    xla = torch.nn.functional.layer_norm(x.to(device), (width,), ones.to(device), zeros.to(device), eps)
    ours = layer_norm_in_own_dtype(x, (width,), ones, zeros, eps)[0]
    return row_lean(xla.cpu(), exact), row_lean(ours, exact)


def bert_rows(width: int) -> tuple[dict[str, torch.Tensor], float]:
    """The float16 rows reaching layer 3's two LayerNorms of bench_verdicts' generated BERT,
    and their epsilon."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_verdicts
    from scratch import work_folder
    from transformers import AutoModel

    path = bench_verdicts.generated_bert(work_folder("norm-lean-") / "bert", 4, width)
    model = AutoModel.from_pretrained(path, dtype=torch.float16).eval()
    layer, rows = model.encoder.layer[3], {}
    for name, norm in (("attention's", layer.attention.output.LayerNorm), ("final", layer.output.LayerNorm)):
        norm.register_forward_pre_hook(lambda _, args, name=name: rows.__setitem__(name, args[0].reshape(-1, width)))
    ids = torch.randint(0, model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
    return rows, layer.output.LayerNorm.eps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default="64,512,1024")
    parser.add_argument("--means", default="0,0.5,2")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--bert", type=int, default=None, help="a generated BERT of this width: its own rows")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    if args.bert is not None:
        print(f"{'BERT layer 3 norm':<26} {'torch-xla':>10} {'statistics':>11} {'beyond':>7}")
        rows_of, eps = bert_rows(args.bert)
        for name, x in rows_of.items():
            shuffled = torch.stack([row[torch.randperm(x.shape[-1], generator=generator)] for row in x])
            for label, rows in ((name, x), (f"{name}, rows shuffled", shuffled)):
                a, b = leans(rows.detach(), eps)
                print(f"{label:<26} {a:>+10.3f} {b:>+11.3f} {a - b:>+7.3f}")
        return
    print(f"{'width':>6} {'mean':>5} {'torch-xla':>10} {'statistics':>11} {'beyond':>7}")
    beyond = []
    for width in (int(w) for w in args.widths.split(",")):
        for mean in (float(m) for m in args.means.split(",")):
            a, b = leans((torch.randn(args.rows, width, generator=generator) + mean).half())
            beyond.append(a - b)
            print(f"{width:>6} {mean:>5} {a:>+10.3f} {b:>+11.3f} {a - b:>+7.3f}")
    print(f"beyond the statistics: {min(beyond):+.3f} to {max(beyond):+.3f} float16 units")


if __name__ == "__main__":
    main()
