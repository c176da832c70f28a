"""The parsers of option values: each takes the text as given on the command line or in the
ini and returns the value, or raises ``argparse.ArgumentTypeError`` saying what to write."""

from __future__ import annotations

import argparse
import math
import re

DTYPES = ("bfloat16", "float16", "float32")
NEAR_TIES = ("leave-out", "exclude", "strict")
GOLDEN_DEVICES_HELP = "auto, cpu, cuda or cuda:N"
DEVICE_MAP_CHOICES = ("stream", "auto", "balanced", "balanced_low_0", "sequential", "cpu")
MAX_MEMORY_FORMS = (
    "40GB (every GPU), 0:60GB,1:60GB,2:40GB (per GPU), cpu:100GB (host), units B/KB/MB/GB/TB or KiB/MiB/GiB/TiB"
)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "B": 1,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number; give a positive integer such as 32"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer (1 or more)")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give 0 or more") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if math.isnan(value) or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def tolerance(text: str) -> float:
    """A difference bound: finite and >= 0."""
    value = _finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative; a tolerance is 0 or more (e.g. 0.01)")
    return value


def probability(text: str) -> float:
    """A false-alarm rate: strictly between 0 and 0.5."""
    value = _finite_float(text)
    if not 0 < value < 0.5:
        raise argparse.ArgumentTypeError(f"{text!r} is not a probability between 0 and 0.5 (e.g. 0.001)")
    return value


def percentage(text: str) -> float:
    value = _finite_float(text)
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage between 0 and 100 (e.g. 95)")
    return value


def correlation(text: str) -> float:
    value = _finite_float(text)
    if not -1 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not between -1 and 1 (e.g. 0.99)")
    return value


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "yes", "on", "1"):
        return True
    if value in ("false", "no", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


def dtype_choice(text: str) -> str:
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    value = aliases.get(text.strip().lower(), text.strip().lower())
    if value not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a supported dtype; choose one of {', '.join(DTYPES)}")
    return value


def golden_device(text: str) -> str:
    value = text.strip().lower()
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"{text!r} is not a golden device; choose {GOLDEN_DEVICES_HELP}")


def size_bytes(text: str) -> int:
    """``40GB`` -> 40_000_000_000; ValueError for anything else."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(text)
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def max_memory_spec(text: str) -> str:
    """Parser of layerparity_max_memory: checks the form, keeps the text."""
    try:
        parse_max_memory(text, gpus=1)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a memory budget ({exc}); accepted forms: {MAX_MEMORY_FORMS}"
        ) from None
    return text


def parse_max_memory(text: str, gpus: int | None = None) -> dict[int | str, str]:
    """'40GB' -> every visible GPU gets 40GB; '0:60GB,1:40GB,cpu:100GB' -> per device
    (accelerate's ``max_memory``)."""
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError("empty")
    if len(parts) == 1 and ":" not in parts[0]:
        size_bytes(parts[0])
        return dict.fromkeys(range(gpus), parts[0]) if gpus else {"cpu": parts[0]}
    out: dict[int | str, str] = {}
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
