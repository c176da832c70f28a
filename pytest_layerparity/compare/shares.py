"""How much of an error lies along given directions: the evidence :mod:`.diagnosis` reads,
measured by the judge (the output's error against the golden's stored directions) and by the
target side (the written keys' and values' error against themselves)."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def error_shares(
    golden: torch.Tensor, target: torch.Tensor, directions: Mapping[str, torch.Tensor], keep: torch.Tensor | None
) -> dict[str, float]:
    """The share of the error ``target - golden`` (over the ``keep`` tokens) each direction
    explains: its squared cosine with the error."""
    width = golden.shape[-1]
    error = target.detach().to("cpu", torch.float64).reshape(-1, width) - golden.to(torch.float64).reshape(-1, width)
    if keep is not None:
        error = error[keep]
    size = float(error.norm())
    shares = {}
    for name, direction in directions.items():
        if tuple(direction.shape) != tuple(golden.shape) or size == 0:
            continue
        d = direction.detach().to("cpu", torch.float64).reshape(-1, width)
        d = d[keep] if keep is not None else d
        norm = float(d.norm())
        if norm > 0:
            shares[name] = (float((error * d).sum()) / (size * norm)) ** 2
    return shares


def self_share(golden: torch.Tensor | None, target: torch.Tensor) -> float | None:
    """The share of ``target - golden`` that is the golden scaled token by token (each
    token's part of it along that token's golden: its squared cosine, summed over tokens and
    weighed by the token's error): near 1 where the target is the golden scaled, by one factor
    or by one per token (a norm's factor). Tokens run along the second-to-last dimension of a
    cache's (batch, heads, tokens, head width) layout, each token's heads together. None
    where they cannot be compared."""
    if golden is None or tuple(golden.shape) != tuple(target.shape):
        return None
    g = golden.detach().to("cpu", torch.float64)
    error = target.detach().to("cpu", torch.float64) - g
    if g.dim() >= 3:  # (..., heads, tokens, width) -> (tokens, heads * width)
        g, error = (t.transpose(-3, -2).reshape(-1, t.shape[-3] * t.shape[-1]) for t in (g, error))
    else:
        g, error = g.reshape(1, -1), error.reshape(1, -1)
    size, sizes = float(error.norm()) ** 2, g.norm(dim=-1) ** 2
    if size == 0:
        return None
    along = torch.where(sizes > 0, (error * g).sum(-1) ** 2 / sizes.clamp(min=torch.finfo(torch.float64).tiny), 0.0)
    return float(along.sum()) / size


def written_shares(golden: Mapping[str, torch.Tensor], written: tuple[torch.Tensor, ...]) -> dict[str, float]:
    """:func:`self_share` of the keys and the values a call wrote, against the golden's
    (``cache.new_keys``, ``cache.new_values``), by part: "keys", "values"."""
    shares = {}
    for part, tensor in zip(("keys", "values"), written, strict=False):
        share = self_share(golden.get(f"cache.new_{part}"), tensor)
        if share is not None:
            shares[part] = share
    return shares
