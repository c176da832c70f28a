"""Memory planning from config.json and safetensors headers alone (no weights read), device
placement settings, and the dtype audit.

The seeds' formulas (for one forward of ``batch`` x ``seq`` tokens)::

    activations = batch * seq * hidden * num_layers * bytes(dtype)
    kv_cache    = 2 * batch * num_layers * seq * num_kv_heads * head_dim * bytes(dtype)
"""
from __future__ import annotations

import argparse
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import modeling

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)\s*$", re.IGNORECASE)
MAX_MEMORY_FORMS = "40GB (every GPU), 0:60GB,1:60GB,2:40GB (per GPU), cpu:100GB (host), units B/KB/MB/GB/TB or KiB/MiB/GiB/TiB"
DEVICE_MAP_CHOICES = ("stream", "auto", "balanced", "balanced_low_0", "sequential", "cpu")
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def size_bytes(text: str) -> int:
    match = _SIZE.match(text)
    if not match:
        raise ValueError(text)
    number, unit = float(match.group(1)), match.group(2).upper()
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(number * scale)


def max_memory_spec(text: str) -> str:
    """argparse type of --max-memory: checks the form, keeps the text."""
    try:
        parse_max_memory(text, gpus=1)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory budget ({exc}); accepted forms: {MAX_MEMORY_FORMS}") from None
    return text


def parse_max_memory(text: str, gpus: int | None = None) -> dict[Any, str]:
    """'40GB' -> every visible GPU gets 40GB; '0:60GB,1:40GB,cpu:100GB' -> per device."""
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError("empty")
    if len(parts) == 1 and ":" not in parts[0]:
        size_bytes(parts[0])
        return {i: parts[0] for i in range(gpus)} if gpus else {"cpu": parts[0]}
    out: dict[Any, str] = {}
    for part in parts:
        if ":" not in part:
            raise ValueError(f"{part!r} has no device; write DEVICE:SIZE")
        device, size = (x.strip() for x in part.split(":", 1))
        size_bytes(size)
        if device.lower() == "cpu":
            out["cpu"] = size
        elif device.isdigit():
            out[int(device)] = size
        else:
            raise ValueError(f"{device!r} is not a GPU index or cpu")
    return out


def device_map_choice(text: str) -> str:
    value = text.strip()
    if value in DEVICE_MAP_CHOICES or re.fullmatch(r"cuda:\d+", value):
        return value
    raise argparse.ArgumentTypeError(f"{text!r} is not a device map; choose {', '.join(DEVICE_MAP_CHOICES)} or cuda:N")


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


def checkpoint_sizes(checkpoint: modeling.Checkpoint) -> CheckpointSizes:
    sizes = CheckpointSizes()
    for name in sorted(set(checkpoint.weight_map.values())):
        for key, info in read_header(checkpoint.root / name).items():
            n = 1
            for dim in info["shape"]:
                n *= dim
            sizes.numel[key] = n
            sizes.by_dtype[info["dtype"]] = sizes.by_dtype.get(info["dtype"], 0) + n * _ITEMSIZE.get(info["dtype"], 4)
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


def make_plan(session: Any) -> Plan:
    cfg = session.config_json
    text = cfg.get("text_config") or cfg
    size = itemsize(session.dtype_name)
    sizes = checkpoint_sizes(session.checkpoint)
    layer_path = session.settings.layer_module or _guess_layer_path(session)
    num_layers = session.num_layers
    per_layer = []
    claimed = set()
    for i in range(num_layers):
        keys = session.checkpoint.layer_keys(layer_path, i)
        claimed.update(keys)
        per_layer.append(sum(sizes.numel.get(k, 0) for k in keys) * size)
    total = sum(sizes.numel.values()) * size
    non_layer = sum(n for k, n in sizes.numel.items() if k not in claimed) * size
    largest = max(range(num_layers), key=lambda i: per_layer[i]) if per_layer else 0
    batch = session.settings.batch_size
    seq = session.settings.seq_len
    hidden = modeling.hidden_size_from_config(cfg) or 0
    heads = text.get("num_attention_heads") or 1
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or (hidden // heads if heads else 0)
    activations = batch * seq * hidden * num_layers * size
    kv = 2 * batch * num_layers * seq * kv_heads * head_dim * size
    return Plan(total, (largest, per_layer[largest] if per_layer else 0), non_layer, activations, kv, sizes.by_dtype)


def _guess_layer_path(session: Any) -> str:
    keys = list(session.checkpoint.weight_map)
    for candidate in modeling.LAYER_LIST_CANDIDATES:
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
    except Exception:  # noqa: BLE001  no CUDA runtime: host memory only
        pass
    return out


def _host_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def fits_whole(session: Any, headroom: float = 1.2) -> bool:
    """Would the whole model (and one forward) fit the golden device?"""
    plan = make_plan(session)
    device = session.golden_device if ":" in session.golden_device or session.golden_device == "cpu" else "cuda:0"
    free = free_memory().get(device, 0)
    return (plan.weights + plan.activations + plan.kv_cache) * headroom < free


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def plan_lines(session: Any) -> list[str]:
    plan = make_plan(session)
    free = free_memory()
    gpus = [d for d in free if d.startswith("cuda")]
    s = session.settings
    need_whole = plan.weights + plan.activations + plan.kv_cache
    need_stream = plan.largest_layer[1] + plan.non_layer + plan.activations
    lines = [
        f"layerparity plan: {session.model_dir} ({session.config_json.get('model_type', '?')}, {session.num_layers} layers), "
        f"dtype {session.dtype_name}, batch {s.batch_size}, seq {s.seq_len}",
        "  weights on disk by dtype: " + ", ".join(f"{k} {gb(v)}" for k, v in sorted(plan.by_dtype.items())),
        f"  weights as {session.dtype_name}: {gb(plan.weights)}; largest layer: layer {plan.largest_layer[0]}, "
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
            lines.append(f"    --device-map {strategy} over {len(gpus)} GPU(s): needs {gb(need_whole)}: {_fits(need_whole, usable)}")
        for g in gpus:
            lines.append(f"    --device-map {g}: needs {gb(need_whole)}: {_fits(need_whole, free[g])}")
    else:
        lines.append("    --device-map auto/balanced/balanced_low_0/sequential/cuda:N: no GPU visible")
    target = session.golden_device if session.golden_device != "cuda" else "cuda:0"
    lines.append(f"    --device-map stream on {target}: needs {gb(need_stream)} (largest layer + outside the layers + activations): "
                 f"{_fits(need_stream, free.get(target, 0))}")
    return lines


def _fits(need: int, free: float) -> str:
    return "fits" if need * 1.2 < free else "does not fit"


# -- dtype audit ---------------------------------------------------------------------------------


@dataclass
class Audit:
    odd: list[tuple[str, str, tuple[int, ...]]]
    fatal: bool
    message: str


def dtype_audit(module: Any, requested: Any, keep: Any = None, fatal_share: float = 0.01) -> Audit:
    """Parameters and buffers whose floating dtype differs from ``requested``. Fatal when
    float32 tensors under a 16-bit request hold more than ``fatal_share`` of the unit's bytes
    (small float32 biases and modules the model keeps in float32 on purpose are reported only)."""
    import torch

    keep = set(keep or ())
    odd, wide, total = [], 0, 0
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if tensor is None or not torch.is_floating_point(tensor) or tensor.device.type == "meta":
            continue
        nbytes = tensor.numel() * tensor.element_size()
        total += nbytes
        if tensor.dtype != requested:
            odd.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)))
            if tensor.dtype == torch.float32 and requested in (torch.bfloat16, torch.float16) and not any(k in name for k in keep):
                wide += nbytes
    fatal = total > 0 and wide / total > fatal_share
    message = ""
    if fatal:
        names = ", ".join(f"{n} ({d}, {list(s)})" for n, d, s in odd if d == "float32")
        message = (f"would materialise in float32 under a {str(requested).removeprefix('torch.')} request "
                   f"({wide / 1e6:.1f} MB of {total / 1e6:.1f} MB): {names}; cast these tensors to the requested dtype "
                   "in the port (or pass --dtype float32)")
    return Audit(odd, fatal, message)
