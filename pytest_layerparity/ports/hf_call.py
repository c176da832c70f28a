"""The HuggingFace decoder layer's call (hidden states, mask, position ids, a KV cache in
decode steps) made into the call of the NxDI port's layer: NxDI's own call of its decoder layer
in NxD's CPU mode (:class:`HFCallToNxDI`), or the positional call of its compiled program
(:class:`HFCallToProgram`).

Decode steps run in a static KV cache, as NxDI's token-generation model does: the past keys
and values padded to the goldens' prompt + decode tokens, the boolean mask False on the
padding, the positions as inputs (int32, as NxDI's ``ModelWrapper.input_generator`` makes
them). NxDI's token-generation attention (``attention_base.compute_for_token_gen``) sets the
scores of masked positions to the dtype's minimum before its softmax, so padded positions
weigh zero (``tests/nxdi`` checks the padded call against the unpadded one in NxD's CPU
mode): one token-generation program serves every decode step of every layer of a kind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .kv_layout import KvLayout
from .nxd_common import PortError, nxd_warnings_quiet


class HFCall(torch.nn.Module):
    """Takes a HuggingFace decoder layer's call (layer ``index`` of the model) and makes the
    call NxDI's layers take: a boolean mask, position ids, the past keys and values of this
    layer from the HF cache; ``call_layer`` (a subclass's) makes the call itself."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        with nxd_warnings_quiet():
            return self._forward(hidden_states, *args, **kwargs)

    def _forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        from ..store.kv_cache import cached_kv, find_kv_cache

        batch, seq, _ = hidden_states.shape
        device = hidden_states.device
        cache = find_kv_cache([args, kwargs])
        past = cached_kv(cache, self.index) if cache is not None else None
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            start = past[0].shape[-2] if past is not None else 0
            position_ids = torch.arange(start, start + seq, device=device)[None].expand(batch, seq)
        mask = kwargs.get("attention_mask")
        given = None  # HF's 4-D mask as NxDI's boolean one (True where attended; additive: 0 there)
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:
            given = mask if mask.dtype == torch.bool else mask == 0
        if past is None:
            if given is not None:
                allowed = given[..., -seq:].expand(batch, 1, seq, seq)
            else:
                allowed = (
                    torch.ones(seq, seq, dtype=torch.bool, device=device).tril()[None, None].expand(batch, 1, seq, seq)
                )
        else:
            length = past[0].shape[-2]  # NxDI's decode mask covers the past only (the new token is attended apart)
            if given is not None:
                allowed = given[..., -1:, :length].expand(batch, 1, 1, length)
            else:
                allowed = torch.ones(batch, 1, 1, length, dtype=torch.bool, device=device)
        output, present = self.call_layer(hidden_states, allowed, position_ids, past)
        if past is None and present is not None and present[0].shape[-2] < seq:
            present = in_order_of_position(present, position_ids)
        if cache is not None and present is not None:
            cache.update(present[0], present[1], self.index)
        return output

    def call_layer(
        self, hidden_states: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, past: tuple | None
    ) -> tuple[torch.Tensor, tuple | None]:
        """The layer's output and the keys and values it made (None if it made none)."""
        raise NotImplementedError


def in_order_of_position(present: tuple, position_ids: torch.Tensor) -> tuple:
    """The keys and values a sliding-window layer's prompt returned, the last W of its
    positions (fewer than the prompt's), from NxDI's ring layout (``get_last_kv_window``:
    position p in slot p mod W, the slots NxDI's token generation writes) into the positions'
    order, the HF cache's; other entries of ``present`` unchanged."""
    keys = present[0]
    batch, heads, width, dim = keys.shape
    latest = position_ids.amax(dim=1).to(keys.device)  # each sample's last position
    slots = (latest[:, None] - width + 1 + torch.arange(width, device=keys.device)) % width
    index = slots[:, None, :, None].expand(batch, heads, width, dim)
    return (keys.gather(2, index), present[1].gather(2, index), *present[2:])


class HFCallToNxDI(HFCall):
    """The HF call made into NxDI's call of its decoder layer (the submodule ``layer``), on one
    rank of ``layout.tp``: the past keys and values split to this rank's heads, the ones the
    ranks made gathered back into the model's heads."""

    def __init__(self, layer: torch.nn.Module, index: int, layout: KvLayout | None = None, rank: int = 0) -> None:
        super().__init__(index)
        self.layer = layer
        self.layout = layout
        self.rank = rank

    def call_layer(
        self, hidden_states: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, past: tuple | None
    ) -> tuple[torch.Tensor, tuple | None]:
        """NxDI's call: the output and the keys and values the layer made (None if it made none)."""
        layout = self.layout
        if past is not None and layout is not None:
            past = tuple(layout.split(t, self.rank) for t in past)
        outputs = self.layer(hidden_states, attention_mask=mask, position_ids=position_ids, past_key_value=past)
        present = outputs[1] if isinstance(outputs, (tuple, list)) and len(outputs) > 1 else None
        if present is not None and layout is not None:
            present = tuple(layout.gather(t) for t in present[:2])
        return outputs[0], present


class HFCallToProgram(HFCall):
    """The HF call made into the positional call of the layer's compiled program (``run``
    finds the program of the call's shape and calls it); its routers are inside the program.
    A decode step's past comes in a static KV cache of ``kv_length`` positions, as NxDI's
    token-generation model holds it, so that every step has the same shape. Sharded
    (``layout()``: how the program's ranks hold the KV heads; None where nothing shards them),
    the past goes in as the ranks hold it, rank after rank along the heads (each rank's program
    takes its own block, :class:`LayerProgram`), and the keys and values the program returns,
    gathered from every rank, come back as the model's heads."""

    def __init__(
        self,
        run: Callable[[tuple[torch.Tensor, ...]], Any],
        index: int,
        kv_length: int,
        layout: Callable[[], KvLayout | None] = lambda: None,
    ) -> None:
        super().__init__(index)
        self.run = run
        self.kv_length = kv_length
        self.layout = layout

    def call_layer(
        self, hidden_states: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, past: tuple | None
    ) -> tuple[torch.Tensor, tuple | None]:
        layout = self.layout()
        if past is not None:
            mask, past = static_kv_cache(mask, past, self.kv_length)
            if layout is not None:
                past = tuple(layout.by_rank(t) for t in past)
        positions = position_ids.to(torch.int32).contiguous()  # as NxDI's ModelWrapper.input_generator makes them
        example = (hidden_states, mask.contiguous(), positions, *(t.contiguous() for t in past or ()))
        outputs = self.run(example)
        if isinstance(outputs, torch.Tensor):
            return outputs, None
        outputs = tuple(outputs)
        if len(outputs) < 3:
            return outputs[0], None
        present = (outputs[1], outputs[2])
        if layout is not None:
            present = tuple(layout.merge(t) for t in present)
        return outputs[0], present


def static_kv_cache(mask: torch.Tensor, past: tuple, length: int) -> tuple[torch.Tensor, tuple]:
    """A decode step's past keys and values ([batch, heads, positions, dim]) padded with zeros
    to ``length`` positions, and its boolean mask ([batch, 1, 1, positions]) with False there:
    NxDI's token-generation attention gives masked positions the dtype's minimum score, so
    they weigh zero (the new token is attended apart, from its own keys and values)."""
    held = past[0].shape[-2]
    if held >= length:
        raise PortError(
            f"a decode step's past of {held} tokens does not fit the token-generation program's KV cache of "
            f"{length} positions (the goldens' prompt + decode tokens)"
        )
    extra = length - held
    padded = tuple(torch.nn.functional.pad(t, (0, 0, 0, extra)) for t in past)
    room = torch.zeros(*mask.shape[:-1], extra, dtype=torch.bool, device=mask.device)
    return torch.cat([mask.to(torch.bool), room], dim=-1), padded
