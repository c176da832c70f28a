"""Each attention head's share of a failing test's error, from sketches: the golden stores
each head's own part of the layer's output (``floor.heads``, one row per head) as a count
sketch of ``SKETCH_SIZE`` numbers, the error is sketched alike, and their inner products
estimate the full ones (to about ``1 / sqrt(SKETCH_SIZE)`` of the sizes' product), so a
layer with many heads stores a few kilobytes per head instead of an output per head."""

from __future__ import annotations

from functools import lru_cache

import torch

#: Numbers per sketch; a tensor no larger is kept whole (its sketch is itself).
SKETCH_SIZE = 4096
#: The seed of the buckets and signs: the same at extraction and in every test.
SKETCH_SEED = 20261129
#: What the diagnosis names each head's share by (``attention_head.<h>``).
HEAD_PREFIX = "attention_head."


@lru_cache(maxsize=2)
def _hashing(numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(SKETCH_SEED + numel)
    buckets = torch.randint(0, SKETCH_SIZE, (numel,), generator=generator)
    signs = torch.randint(0, 2, (numel,), generator=generator, dtype=torch.int8).to(torch.float64) * 2 - 1
    return buckets, signs


def sketch(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s count sketch in float64: each element added, with its sign, into its bucket
    (fixed by the tensor's size); a tensor of at most ``SKETCH_SIZE`` elements as it is."""
    flat = tensor.detach().to("cpu", torch.float64).flatten()
    if flat.numel() <= SKETCH_SIZE:
        return flat
    buckets, signs = _hashing(flat.numel())
    return torch.zeros(SKETCH_SIZE, dtype=torch.float64).index_add_(0, buckets, flat * signs)


def unit_sketches(parts: list[torch.Tensor]) -> torch.Tensor:
    """Each of ``parts`` sketched and scaled to length 1 (only their directions count: the
    golden's own dtype keeps them, a float16 one without overflow), one per row."""
    rows = torch.stack([sketch(part) for part in parts])
    return rows / rows.norm(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float64).tiny)


def head_shares(
    golden: torch.Tensor, target: torch.Tensor, heads: torch.Tensor | None, keep: torch.Tensor | None
) -> dict[str, float]:
    """The share of the error ``target - golden`` (over the ``keep`` tokens) each head's sketched
    part explains (``heads``: one sketch per row): their squared cosine, by ``HEAD_PREFIX`` and
    the head's index. None stored, or of another size: none."""
    if heads is None or heads.dim() != 2 or heads.shape[1] != min(golden.numel(), SKETCH_SIZE):
        return {}
    width = golden.shape[-1]
    error = target.detach().to("cpu", torch.float64).reshape(-1, width) - golden.to(torch.float64).reshape(-1, width)
    if keep is not None:
        error[~keep] = 0
    sketched = sketch(error)
    size = float(sketched.norm())
    shares = {}
    for index, row in enumerate(heads.to(torch.float64)):
        norm = float(row.norm())
        if size > 0 and norm > 0:
            shares[f"{HEAD_PREFIX}{index}"] = (float(sketched @ row) / (size * norm)) ** 2
    return shares
