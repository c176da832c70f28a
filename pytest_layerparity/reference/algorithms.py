"""Other legitimate algorithms of an op than the one torch's kernel uses, for the perturbed
runs (:mod:`.perturb`) to draw from: a variance in one pass, a float16 layer norm computed in
float16."""

from __future__ import annotations

from typing import Any

import torch

#: Input dtypes whose layer norm a legitimate kernel may compute in that dtype itself: its mean,
#: variance, 1/std, normalised values, scale and shift each rounded to it, so the row's
#: statistics carry a float16 rounding error shared by the whole row. XLA lowers a layer
#: norm to a batch norm in the operand's type: torch-xla's CPU float16 LayerNorm measured a
#: per-row scale error of 0.75 float16 units of 2^-11 (sd; eager 0.09) and its bfloat16 one
#: computed as eager (bench/README.md). Not bfloat16, as for the matmuls' accumulation.
OWN_DTYPE_NORMS = frozenset({torch.float16})


def layer_norm_in_own_dtype(
    x: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``native_layer_norm`` computed in ``x``'s dtype: each op's result in it (the
    statistics too), the scale and the shift applied one after the other. The returned mean
    and 1/std take the dtypes torch's own decomposition gives them."""
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    var, mean = torch.var_mean(x, dims, correction=0, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    stats = x.dtype if x.device.type in ("cpu", "mtia") else torch.float32
    return out, mean.to(stats), rstd.to(stats)


def one_pass_var_mean(
    x: torch.Tensor, dim: Any = None, *, correction: Any = None, keepdim: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.var_mean`` the way one-pass kernels compute it (fused norms that accumulate the
    sum and the sum of squares together): E[x^2] - E[x]^2, rescaled for the correction. The
    other legitimate variance algorithm beside the two-pass one torch uses; its cancellation
    error is larger where a row's mean is large against its spread."""
    dims = list(range(x.dim())) if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    dims = [d % max(x.dim(), 1) for d in dims]
    count = 1
    for d in dims:
        count *= x.shape[d]
    mean = torch.mean(x, dims, keepdim=True)
    var = (torch.mean(x * x, dims, keepdim=True) - mean * mean).clamp_min(0)
    c = 1 if correction is None else float(correction)
    if c:
        var = var * (count / max(count - c, 1))
    if not keepdim:
        var, mean = var.squeeze(dims), mean.squeeze(dims)
    return var, mean
