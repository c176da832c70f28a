"""One captured call as it is stored: its tensors (CPU copies) and the JSON spec that
rebuilds it (:mod:`.callspec`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

Device = str | torch.device


@dataclass
class CallRecord:
    """One captured call: flat CPU tensors and the spec that rebuilds args, kwargs, output."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    spec: dict[str, Any] = field(default_factory=dict)
