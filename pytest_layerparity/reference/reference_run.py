"""What one forward pass of the reference model captured (:class:`ReferenceRun`): each
selected layer's call, per prompt and decode step, and the model's own input and output."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..store.golden import MODEL_IO_KEY
from .spill import SpilledCalls

if TYPE_CHECKING:
    import torch


@dataclass
class ReferenceRun:
    """What one forward pass of the reference model captured."""

    calls: SpilledCalls  # layer -> its call (on disk until its golden is written)
    decode_calls: SpilledCalls  # (layer, step) -> its call
    model_io: dict[str, torch.Tensor] = field(default_factory=dict)
    layer_path: str = ""
    decode_logits: list[torch.Tensor] = field(default_factory=list)  # each decode step's logits (CPU)
    model_golden: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None  # whole-model golden and metadata
    spilled_io: SpilledCalls | None = None  # model_io's tensors kept on disk (streaming: the prompt's logits)
    uncalled: dict[int, str] = field(default_factory=dict)  # layer -> its class: of all, those the prompt skipped
    model_class: str = ""
    decode_skipped: str = ""  # why a model without an LM head has no decode steps
    prompt_kv: str | None = None  # why the prompt goldens hold no keys and values their call wrote (None: they do)

    def io_tensors(self) -> dict[str, torch.Tensor]:
        """``model_io``'s tensors, with those kept on disk read back."""
        io = dict(self.model_io)
        if self.spilled_io is not None and MODEL_IO_KEY in self.spilled_io:
            io.update(self.spilled_io[MODEL_IO_KEY].tensors)
        return io

    def drop_io(self) -> None:
        """Forget ``model_io`` (written), on disk too."""
        self.model_io.clear()
        self.decode_logits.clear()
        if self.spilled_io is not None:
            self.spilled_io.clear()
