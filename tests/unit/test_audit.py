"""The reference's own forward failing on tensors left in another dtype than requested."""

from __future__ import annotations

import pytest
import torch

from pytest_layerparity.errors import ModelError
from pytest_layerparity.reference.audit import mixed_dtype_failure


class Positions(torch.nn.Module):
    """A model whose position table its constructor makes float32 whatever the dtype asked
    (as transformers' Reformer does): in bfloat16 its norm gets a float32 input."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.ones(4, 8, dtype=torch.float32))
        self.norm = torch.nn.LayerNorm(8, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.table)


def test_a_forward_failing_on_mixed_dtypes_names_the_tensors_and_the_fix():
    model, x = Positions(), torch.ones(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ModelError) as info, mixed_dtype_failure(model, torch.bfloat16):
        model(x)
    message = str(info.value)
    assert message.startswith("the reference model's own forward fails in bfloat16 (RuntimeError: ")
    assert "Positions with tensors in another dtype than --dtype bfloat16" in message
    assert "table (float32)" in message and "norm.weight" not in message
    assert message.endswith("extract with --dtype float32 (or make a checkpoint whose model casts them)")


def test_tensors_kept_on_purpose_or_other_errors_pass_through():
    model, x = Positions(), torch.ones(4, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError) as info, mixed_dtype_failure(model, torch.bfloat16, keep=["table"]):
        model(x)
    assert not isinstance(info.value, ModelError)
    with pytest.raises(RuntimeError, match=r"^boom$"), mixed_dtype_failure(model, torch.bfloat16):
        raise RuntimeError("boom")
    with mixed_dtype_failure(model, torch.float32):  # nothing raised: nothing to say
        pass
