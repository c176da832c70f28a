"""Memory planning from config.json and safetensors headers alone (no weights read), and
the choice of placement it informs.

The seeds' formulas (for one forward of ``batch`` x ``seq`` tokens)::

    activations = batch * seq * hidden * num_layers * bytes(dtype)
    kv_cache    = 2 * batch * num_layers * seq * num_kv_heads * head_dim * bytes(dtype)
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .model import LAYER_LIST_CANDIDATES, Checkpoint, ModelSource, hidden_size_from_config

_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


# -- checkpoint sizes from headers -------------------------------------------------------------


def read_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return header


@dataclass
class CheckpointSizes:
    by_dtype: dict[str, int] = field(default_factory=dict)  # bytes on disk per stored dtype
    numel: dict[str, int] = field(default_factory=dict)  # per tensor


def checkpoint_sizes(checkpoint: Checkpoint) -> CheckpointSizes:
    sizes = CheckpointSizes()
    for name in sorted(set(checkpoint.weight_map.values())):
        for key, info in read_header(checkpoint.root / name).items():
            n = 1
            for dim in info["shape"]:
                n *= dim
            sizes.numel[key] = n
            nbytes = n * _ITEMSIZE.get(info["dtype"], 4)
            sizes.by_dtype[info["dtype"]] = sizes.by_dtype.get(info["dtype"], 0) + nbytes
    return sizes


def itemsize(dtype_name: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[dtype_name]


@dataclass
class Plan:
    weights: int
    largest_layer: tuple[int, int]
    non_layer: int
    activations: int
    kv_cache: int
    by_dtype: dict[str, int]


def make_plan(model: ModelSource, dtype_name: str, batch: int, seq: int) -> Plan:
    cfg = model.config_json
    text = cfg.get("text_config") or cfg
    size = itemsize(dtype_name)
    sizes = checkpoint_sizes(model.checkpoint)
    layer_path = model.layer_module or _guess_layer_path(model.checkpoint)
    num_layers = model.num_layers
    per_layer = []
    claimed = set()
    for i in range(num_layers):
        keys = model.checkpoint.layer_keys(layer_path, i)
        claimed.update(keys)
        per_layer.append(sum(sizes.numel.get(k, 0) for k in keys) * size)
    total = sum(sizes.numel.values()) * size
    non_layer = sum(n for k, n in sizes.numel.items() if k not in claimed) * size
    largest = max(range(num_layers), key=lambda i: per_layer[i]) if per_layer else 0
    hidden = hidden_size_from_config(cfg) or 0
    heads = text.get("num_attention_heads") or 1
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or (hidden // heads if heads else 0)
    activations = batch * seq * hidden * num_layers * size
    kv = 2 * batch * num_layers * seq * kv_heads * head_dim * size
    return Plan(total, (largest, per_layer[largest] if per_layer else 0), non_layer, activations, kv, sizes.by_dtype)


def _guess_layer_path(checkpoint: Checkpoint) -> str:
    keys = list(checkpoint.weight_map)
    for candidate in LAYER_LIST_CANDIDATES:
        if any(k.startswith(candidate + ".0.") for k in keys):
            return candidate
    return "model.layers"


def free_memory() -> dict[str, int]:
    """Free memory per visible device: 'cpu' (MemAvailable) and 'cuda:N'."""
    out = {"cpu": _host_available()}
    try:
        import torch

        for i in range(torch.cuda.device_count()):
            free, _ = torch.cuda.mem_get_info(i)
            out[f"cuda:{i}"] = int(free)
    except Exception:
        pass
    return out


def _host_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_golden_device(choice: str) -> str:
    """``--golden-device``: ``auto`` is CUDA when visible, else the CPU."""
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def fits_whole(plan: Plan, golden_device: str, headroom: float = 1.2) -> bool:
    """Would the whole model (and one forward) fit the golden device?"""
    device = golden_device if ":" in golden_device or golden_device == "cpu" else "cuda:0"
    free = free_memory().get(device, 0)
    return (plan.weights + plan.activations + plan.kv_cache) * headroom < free


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def plan_lines(model: ModelSource, dtype_name: str, batch: int, seq: int, golden_device: str) -> list[str]:
    plan = make_plan(model, dtype_name, batch, seq)
    free = free_memory()
    gpus = [d for d in free if d.startswith("cuda")]
    need_whole = plan.weights + plan.activations + plan.kv_cache
    need_stream = plan.largest_layer[1] + plan.non_layer + plan.activations
    lines = [
        f"layerparity plan: {model.model_dir} ({model.config_json.get('model_type', '?')}, "
        f"{model.num_layers} layers), dtype {dtype_name}, batch {batch}, seq {seq}",
        "  weights on disk by dtype: " + ", ".join(f"{k} {gb(v)}" for k, v in sorted(plan.by_dtype.items())),
        f"  weights as {dtype_name}: {gb(plan.weights)}; largest layer: layer {plan.largest_layer[0]}, "
        f"{gb(plan.largest_layer[1])}; outside the layers: {gb(plan.non_layer)}",
        f"  activations (batch x seq x hidden x layers x bytes): {gb(plan.activations)}",
        f"  KV cache (2 x batch x layers x seq x kv_heads x head_dim x bytes): {gb(plan.kv_cache)}",
        "  devices: " + ", ".join(f"{d} {gb(v)} free" for d, v in free.items()),
        "  strategies:",
        f"    whole model on cpu: needs {gb(need_whole)}: {_fits(need_whole, free['cpu'])}",
    ]
    if gpus:
        total = sum(free[g] for g in gpus)
        for strategy in ("auto", "balanced", "balanced_low_0", "sequential"):
            usable = total - (free[gpus[0]] if strategy == "balanced_low_0" and len(gpus) > 1 else 0) * 0.5
            lines.append(
                f"    --device-map {strategy} over {len(gpus)} GPU(s): needs {gb(need_whole)}: "
                f"{_fits(need_whole, usable)}"
            )
        for g in gpus:
            lines.append(f"    --device-map {g}: needs {gb(need_whole)}: {_fits(need_whole, free[g])}")
    else:
        lines.append("    --device-map auto/balanced/balanced_low_0/sequential/cuda:N: no GPU visible")
    target = golden_device if golden_device != "cuda" else "cuda:0"
    lines.append(
        f"    --device-map stream on {target}: needs {gb(need_stream)} (largest layer + outside the layers "
        f"+ activations): {_fits(need_stream, free.get(target, 0))}"
    )
    return lines


def _fits(need: int, free: float) -> str:
    return "fits" if need * 1.2 < free else "does not fit"
