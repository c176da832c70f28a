"""Layers the model's forward does not call on the golden input (a text-only forward skips
its cross-attention layers): found as the reference runs, recorded in the store, and left
out of the target's selection with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pytest_layerparity.capture.calls import called_layers
from pytest_layerparity.options import make_settings
from pytest_layerparity.selection import SelectionError
from pytest_layerparity.session import LayerParitySession
from pytest_layerparity.store.golden import GoldenStore
from pytest_layerparity.store.identity import EXTRACTION_KEYS

MODEL = Path(__file__).resolve().parents[2] / "fixtures" / "minimax_m2_tiny"  # 6 layers


class SkipsCrossAttention(torch.nn.Module):
    """A stack whose forward skips the layers it has no cross-attention states for."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        self.cross_attention_layers = [1]

    def forward(self, x: torch.Tensor, cross_attention_states: torch.Tensor | None = None) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i in self.cross_attention_layers and cross_attention_states is None:
                continue
            x = layer(x)
        return x


def test_the_layers_a_forward_skips_are_found_and_the_hooks_go():
    model = SkipsCrossAttention()
    called: set[int] = set()
    with called_layers(model.layers, called):
        model(torch.zeros(1, 4))
    assert called == {0, 2}
    assert all(not layer._forward_pre_hooks for layer in model.layers)


def session(tmp_path: Path, **values) -> LayerParitySession:
    store = GoldenStore(tmp_path / "goldens")
    header = {"model": {"num_layers": 6}, "dtype": "float32", "uncalled_layers": {"3": "CrossAttentionLayer"}}
    store.begin(header, compare_keys=EXTRACTION_KEYS)
    return LayerParitySession(make_settings(model=str(MODEL), golden_dir=str(store.root), xla=True, **values), tmp_path)


def test_the_target_leaves_out_the_layers_the_extraction_saw_skipped_and_says_why(tmp_path):
    s = session(tmp_path)
    assert s.selected_layers == [0, 1, 2, 4, 5]
    assert [r.id for r in s.chains] == ["layers_0-2", "layers_4-5"]
    (line,) = [line for line in s.header_lines() if "not tested" in line]
    assert "layer 3 (CrossAttentionLayer), which the model's forward does not call on the golden input" in line


def test_selecting_only_a_skipped_layer_is_refused_with_the_reason(tmp_path):
    with pytest.raises(SelectionError, match=r"--layers 3: layer 3 \(CrossAttentionLayer\), which .* no golden"):
        session(tmp_path, layers="3").selected_layers  # noqa: B018


def test_a_range_over_a_skipped_layer_is_refused_naming_the_ranges_without_it(tmp_path):
    with pytest.raises(SelectionError, match=r"range 2-4: layer 3 .* name ranges without it \(such as 2,4\)"):
        session(tmp_path, layer_ranges="0-1,2-4").layer_ranges  # noqa: B018


def test_an_extraction_selects_every_layer_it_is_asked_for(tmp_path):
    assert session(tmp_path, gpu_golden=True, extract=True).selected_layers == list(range(6))
