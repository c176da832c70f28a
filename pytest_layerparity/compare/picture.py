"""A failing test's error, pictured against the golden's own rounding: how the error of each
element is distributed (beside the golden's), and how it falls per token and per channel, so
that an error confined to one token or one channel is seen at a glance.

Everything is measured against the precision floor (``ref``, the layer in higher precision):
the target's error ``target - ref`` and the golden's ``golden - ref``, in units of the golden's
root-mean-square error per element. Per token and per channel the ratio of the two norms, the
golden's floored at its median as ``token_noise_ratio`` floors it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch

#: At most this many points per profile: longer ones keep each block's largest value.
POINTS = 256
#: The histogram's bin edges, in units of the golden's rms error per element: decades from
#: 1e-3 to 1e5, four bins each, with everything below and above in the end bins.
EDGES = [10 ** (k / 4) for k in range(-12, 21)]


@dataclass(frozen=True)
class FailurePicture:
    """``tokens`` and ``channels``: the per-token and per-channel error ratios (``block``
    tokens or channels per point, the block's largest); ``target_bins`` and ``golden_bins``:
    the fraction of elements whose error falls in each bin of :data:`EDGES` (one more bin
    than edges: below the first, between each pair, above the last)."""

    tokens: list[float]
    token_block: int
    channels: list[float]
    channel_block: int
    target_bins: list[float]
    golden_bins: list[float]
    worst_token: int
    worst_channel: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> FailurePicture:
        return cls(**json.loads(text))

    def caption(self) -> str:
        """The picture in words: where the error is largest, and how much of it is beyond the
        golden's own rounding."""
        beyond = sum(self.target_bins[_bin(10.0) :])
        return (
            f"largest per-token ratio {max(self.tokens, default=0):.3g} at token {self.worst_token}, per-channel "
            f"{max(self.channels, default=0):.3g} at channel {self.worst_channel}; {100 * beyond:.3g}% of the "
            "elements err beyond 10 times the golden's rms rounding error"
        )


def _bin(value: float) -> int:
    return sum(1 for edge in EDGES if value >= edge)


def _profile(ratios: torch.Tensor) -> tuple[list[float], int]:
    """``ratios`` in at most :data:`POINTS` points (each block's largest), and the block size."""
    block = max(1, math.ceil(ratios.numel() / POINTS))
    padded = torch.nn.functional.pad(ratios, (0, -ratios.numel() % block), value=0.0)
    peaks = padded.reshape(-1, block).amax(dim=1)
    return [float(f"{v:.3g}") for v in peaks.tolist()], block


def _ratios(target_sq: torch.Tensor, golden_sq: torch.Tensor) -> torch.Tensor:
    golden = golden_sq.sqrt()
    floor = torch.maximum(golden, golden.median()).clamp_min(1e-300)
    return target_sq.sqrt() / floor


def _fractions(errors: torch.Tensor) -> list[float]:
    edges = torch.tensor(EDGES, dtype=errors.dtype)
    counts = torch.bincount(torch.bucketize(errors, edges, right=True), minlength=len(EDGES) + 1)
    return [float(f"{c / max(errors.numel(), 1):.3g}") for c in counts.tolist()]


def failure_picture(
    golden: torch.Tensor, target: torch.Tensor, reference: torch.Tensor, keep: torch.Tensor | None = None
) -> FailurePicture | None:
    """The picture of ``target``'s error against ``golden``'s, both from the floor ``reference``
    (rows: tokens, the last dimension: channels; ``keep``: the tokens the verdict judged).
    None where the golden has no rounding error to measure against."""
    width = golden.shape[-1]
    g = golden.detach().reshape(-1, width).to("cpu", torch.float64)
    t = target.detach().reshape(-1, width).to("cpu", torch.float64)
    r = reference.detach().reshape(-1, width).to("cpu", torch.float64)
    if keep is not None:
        g, t, r = g[keep], t[keep], r[keep]
    err_t, err_g = (t - r), (g - r)
    rms = float(err_g.square().mean().sqrt()) if err_g.numel() else 0.0
    if not rms > 0:
        return None
    token_ratios = _ratios(err_t.square().sum(dim=1), err_g.square().sum(dim=1))
    channel_ratios = _ratios(err_t.square().sum(dim=0), err_g.square().sum(dim=0))
    tokens, token_block = _profile(token_ratios)
    channels, channel_block = _profile(channel_ratios)
    kept = torch.arange(golden.numel() // width)[keep] if keep is not None else torch.arange(g.shape[0])
    return FailurePicture(
        tokens=tokens,
        token_block=token_block,
        channels=channels,
        channel_block=channel_block,
        target_bins=_fractions(err_t.abs().flatten() / rms),
        golden_bins=_fractions(err_g.abs().flatten() / rms),
        worst_token=int(kept[int(token_ratios.argmax())]),
        worst_channel=int(channel_ratios.argmax()),
    )
