"""How NxDI's attention lays a model's key/value heads over tensor-parallel ranks, and the
moves between the model's heads and the ranks' (NxD's CPU mode, one process per rank, and the
compiled programs, all ranks in one)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KvLayout:
    """How the port's attention lays the model's key/value heads over the ranks, as NxDI's
    GQA sharding does (``modules/attention/gqa.py``): the ``source`` heads, each repeated
    ``repeats`` times in place (``repeat_interleave``: REPLICATE_TO_TP_DEGREE when there are
    fewer KV heads than ranks, CONVERT_TO_MHA when the ranks do not divide them), padded to
    ``total`` heads, ``total / tp`` consecutive heads on each rank."""

    strategy: str
    source: int
    total: int
    repeats: int
    tp: int

    @classmethod
    def of(cls, layer: torch.nn.Module, tp: int) -> KvLayout | None:
        """The layout of ``layer``'s attention (None where no module of it shards KV heads)."""
        for module in layer.modules():
            source = getattr(module, "_src_num_key_value_heads", None)
            strategy = getattr(module, "sharding_strategy", None)
            total = getattr(module, "num_key_value_heads", None)
            if isinstance(source, int) and isinstance(total, int) and strategy is not None:
                name = getattr(strategy, "name", str(strategy))
                heads = getattr(module, "_src_num_attention_heads", total)
                # none replicated where total == source (NxDI may still name CONVERT_TO_MHA at tp 1)
                repeats = 1 if total == source else heads // source if name == "CONVERT_TO_MHA" else total // source
                return cls(name, source, total, repeats, tp)
        return None

    def describe(self) -> str:
        per_rank = self.total // self.tp
        if self.total == self.source:
            return f"{self.source} KV heads, {per_rank} on each rank"
        return f"{self.source} KV heads as {self.total} ({self.strategy}), {per_rank} on each rank"

    def rank_heads(self, rank: int) -> list[int | None]:
        """The source head of each of ``rank``'s heads (None: padding)."""
        per_rank = self.total // self.tp
        return [
            j // self.repeats if j < self.source * self.repeats else None
            for j in range(rank * per_rank, (rank + 1) * per_rank)
        ]

    def split(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """A [batch, source heads, positions, dim] tensor as ``rank`` holds it."""
        heads = self.rank_heads(rank)
        if heads == list(range(self.source)):
            return tensor
        picked = [tensor[:, h : h + 1] if h is not None else torch.zeros_like(tensor[:, :1]) for h in heads]
        return torch.cat(picked, dim=1).contiguous()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Each rank's [batch, heads on the rank, positions, dim] tensor gathered over the ranks,
        one copy of each source head kept (in the model's order)."""
        import torch.distributed as dist

        if self.tp > 1:
            parts = [torch.empty_like(tensor) for _ in range(self.tp)]
            dist.all_gather(parts, tensor.contiguous())
            tensor = torch.cat(parts, dim=1)
        return self.merge(tensor)

    def by_rank(self, tensor: torch.Tensor) -> torch.Tensor:
        """A [batch, source heads, positions, dim] tensor as the ranks hold it, rank after rank
        along the heads (``total`` of them): rank r's ``total / tp`` heads are block r."""
        return torch.cat([self.split(tensor, rank) for rank in range(self.tp)], dim=1)

    def merge(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranks' heads, rank after rank (``total`` of them), as the model's source heads:
        one copy of each kept."""
        if self.total == self.source:
            return tensor
        return tensor[:, [h * self.repeats for h in range(self.source)]]
