"""Ports of the tests' own that shard wrong: each a subclass of NxDI's decoder layer (and
application class, named with ``-o layerparity_nxdi_app=...``) with one planted sharding bug in layer 1. Each
computes what NxDI's layer computes in one process (tensor parallelism 1) and goes wrong only
sharded over ranks, as a sharding bug does."""

from __future__ import annotations

import torch

BUGGY_LAYER = 1


def tensor_parallel_size() -> int:
    from neuronx_distributed.parallel_layers import parallel_state

    return parallel_state.get_tensor_model_parallel_size()


def rank_blocks_rolled(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """``tensor`` with its rank blocks along ``dim`` moved by one rank (rank r then holds what
    rank r + 1 should)."""
    tp = tensor_parallel_size()
    return torch.roll(tensor, shifts=-(tensor.shape[dim] // tp), dims=dim) if tp > 1 else tensor
