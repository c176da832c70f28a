"""A decoder layer's per-token sub-modules (its dense MLP and its norms) run over blocks of
tokens, in the passes that hold more than the golden forward does: the precision floor
(every op one precision wider) and the noise envelope's perturbed runs (each op's result
computed wider before it is rounded). These modules compute each token alone, so their
output is the same block by block; what changes is their widest intermediates (tokens x
intermediate size for an MLP, several at once; tokens x hidden size in float32 or float64
for a norm), which are then held for one block of tokens instead of the whole prompt: at
long prompts they are the largest tensors of a dense layer's wider passes.

Only a layer's direct children are blocked: one named ``mlp``/``feed_forward``/``ffn`` (or a
class named ``*MLP``) that holds no router (a mixture of experts is left whole: its routers
are recorded per call, and the wider passes already run its experts one at a time), and one
named ``*norm`` or of a class named ``*Norm``. A child called with more than its input, or
that does not return one tensor of its input's shape, is run whole."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..capture.router_hooks import looks_like_router

#: Elements of the widest intermediate of one block of tokens (float32: 4 MiB): a block has
#: ``TOKEN_BLOCK_ELEMENTS // widest output`` tokens.
TOKEN_BLOCK_ELEMENTS = 1 << 20

_MLP_NAMES = frozenset({"mlp", "feed_forward", "ffn"})


def is_norm(name: str, child: torch.nn.Module) -> bool:
    """Whether a layer's child ``name`` is a norm: named ``*norm`` or of a class ``*Norm``."""
    return name.lower().endswith("norm") or type(child).__name__.endswith("Norm")


def per_token_children(layer: torch.nn.Module) -> list[tuple[str, torch.nn.Module, int]]:
    """The children of ``layer`` run in blocks of tokens, each with its widest linear output
    (an MLP's intermediate size: what sets how many tokens a block has; 0 for a norm, whose
    widest intermediate is its input's width)."""
    found = []
    for name, child in layer.named_children():
        cls = type(child).__name__
        if is_norm(name, child):
            found.append((name, child, 0))
            continue
        if name.lower() not in _MLP_NAMES and not cls.endswith("MLP"):
            continue
        if any(looks_like_router(sub, module) for sub, module in child.named_modules() if sub):
            continue
        widths = [m.out_features for m in child.modules() if isinstance(m, torch.nn.Linear)]
        if widths:
            found.append((name, child, max(widths)))
    return found


def block_rows(shape: torch.Size, width: int, elements: int = TOKEN_BLOCK_ELEMENTS) -> int:
    """Tokens (along the second-to-last dim of an input of ``shape``) in one block, so that
    an intermediate ``width`` wide holds at most ``elements`` (at least one token)."""
    return max(1, elements // max(1, width * math.prod(shape[:-2])))


def write_block(out: torch.Tensor | None, part: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """``part`` written into ``out`` at ``start`` along ``dim``; ``out`` made for the first
    block, ``length`` long along ``dim`` and otherwise shaped and typed as ``part``. A
    computation over blocks fills one output as each block comes (a list of blocks joined
    at the end holds the output twice, and its small tensors between the blocks' freed
    temporaries grow the heap)."""
    if out is None:
        shape = list(part.shape)
        shape[dim] = length
        out = part.new_empty(shape)
    out.narrow(dim, start, part.shape[dim]).copy_(part)
    return out


def _blocked(forward: Callable[..., Any], width: int, elements: int) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        # one tensor, by position or by name (DBRX calls its MLP as ffn(hidden_states=...))
        named = next(iter(kwargs), None) if len(kwargs) == 1 and not args else None
        x = args[0] if len(args) == 1 and not kwargs else kwargs[named] if named is not None else None
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return forward(*args, **kwargs)

        def call(part: torch.Tensor) -> Any:
            return forward(part) if named is None else forward(**{named: part})

        tokens, rows = x.shape[-2], block_rows(x.shape, max(width, x.shape[-1]), elements)
        if tokens <= rows:
            return call(x)
        out = None
        for start in range(0, tokens, rows):
            size = min(rows, tokens - start)
            part = call(x.narrow(-2, start, size))
            if out is None and (not isinstance(part, torch.Tensor) or part.shape[:-1] != (*x.shape[:-2], size)):
                return call(x)  # not token by token as far as its output shows: run it whole
            out = write_block(out, part, -2, start, tokens)
            del part
        return out

    return run


@contextmanager
def in_token_blocks(layer: torch.nn.Module, elements: int = TOKEN_BLOCK_ELEMENTS) -> Iterator[None]:
    """While active, ``layer``'s dense MLP and norms (:func:`per_token_children`) run over
    blocks of tokens whose widest intermediate holds at most ``elements``."""
    patched = []
    try:
        for _, child, width in per_token_children(layer):
            patched.append((child, child.__dict__.get("forward")))
            child.forward = _blocked(child.forward, width, elements)
        yield
    finally:
        for child, own in reversed(patched):
            if own is None:
                del child.forward
            else:
                child.forward = own
