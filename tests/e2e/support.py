"""Paths and set-up the end-to-end tests share."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / "fixtures" / "minimax_m2_tiny"
DEFAULT_GOLDENS = ROOT / "fixtures" / "goldens" / "minimax_m2_tiny"


def copy_goldens(dest: Path, decode: bool = True) -> Path:
    """A copy of the committed default goldens at ``dest``; ``decode=False``: as extracted with
    ``--decode-steps 0 -o layerparity_logits_topk=0`` (the layers' prompt goldens only), for tests about
    the per-layer prompt tests alone."""
    import json
    import shutil

    shutil.copytree(DEFAULT_GOLDENS, dest)
    if not decode:
        manifest = json.loads((dest / "manifest.json").read_text())
        for key in [k for k in manifest["files"] if ".decode_" in k or k == "model_logits"]:
            (dest / manifest["files"].pop(key)["file"]).unlink()
        manifest["inputs"]["decode_steps"] = 0
        (dest / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return dest


def default_project(pytester, decode: bool = True, goldens: str = "goldens"):
    """A pytester folder whose ini points the plugin at the embedded default model and a copy
    of its committed goldens at ``goldens`` (``decode=False``: the prompt goldens only, with the
    decode steps and the whole-model golden off)."""
    copy_goldens(pytester.path / goldens, decode=decode)
    off = "layerparity_decode_steps = 0\nlayerparity_logits_topk = 0\n" if not decode else ""
    pytester.makeini(f"[pytest]\nlayerparity_model = {DEFAULT_MODEL}\nlayerparity_golden_dir = {goldens}\n{off}")
    return pytester


def cache_dropped(layer: int) -> str:
    """A conftest whose port of layer ``layer`` drops the KV cache it is given (the model's own
    layer called without it): an attention layer attends to the new token alone and appends
    nothing; a linear-attention layer starts its convolution and recurrence from nothing."""
    return f"""
class CacheDropped(__import__("torch").nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, *args, **kwargs):
        kwargs = {{k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")}}
        return self.layer(hidden_states, *args, **kwargs)

def pytest_layerparity_build_target_layer(layer_idx, reference_layer, model_config, device):
    return CacheDropped(reference_layer).to(device) if layer_idx == {layer} else None
"""


def model_with_other_weights(dest: Path, layers: list[int], tensor: str = "self_attn.q_proj.weight") -> Path:
    """A copy of the embedded default model at ``dest`` (same config) whose ``tensor`` of each
    of ``layers`` differs: goldens of the default model are then of other weights there."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(DEFAULT_MODEL, dest)
    weight_map = json.loads((dest / "model.safetensors.index.json").read_text())["weight_map"]
    for index in layers:
        key = f"model.layers.{index}.{tensor}"
        shard = dest / weight_map[key]
        tensors = load_file(shard)
        tensors[key] = tensors[key] * 1.01
        save_file(tensors, shard, metadata={"format": "pt"})
    return dest


def printed_before_summary(result) -> str:
    """What a run printed before pytest's short test summary, which repeats each failure's message
    (in full where the terminal is wide enough)."""
    return result.stdout.str().split("short test summary info")[0] + result.stderr.str()


#: A conftest part: each control run (the model's own layer built on the device) appends its
#: layer to controls.txt in the project.
COUNT_CONTROLS = """
import pytest

from pytest_layerparity.replay.runner import TargetSide

@pytest.fixture(autouse=True)
def count_controls(monkeypatch, request):  # undone after each test: pytester runs in this process
    own = TargetSide.own_layer

    def counted(self, index, on_device=True):
        if on_device:  # the control: the model's own layer on the device
            with open(request.config.rootpath / "controls.txt", "a") as out:
                out.write(f"{index}\\n")
        return own(self, index, on_device)

    monkeypatch.setattr(TargetSide, "own_layer", counted)
"""

#: A conftest part: a correct port, the model's own layer through the build hook.
IDENTITY_PORT = """
import pytest

@pytest.hookimpl
def pytest_layerparity_build_target_layer(layer_idx, reference_layer, model_config, device):
    return reference_layer.to(device)
"""

#: A conftest part: a port's limits so tight that every port leaves them (its control runs).
TINY_REACH = """
import pytest
from pytest_layerparity.compare import envelope

@pytest.fixture(autouse=True)
def tiny_reach(monkeypatch):
    monkeypatch.setattr(envelope, "CONTROLLED_REACH", 1e-3)
"""
