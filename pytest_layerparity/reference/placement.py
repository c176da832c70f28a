"""Where the reference model runs: streamed one layer at a time, or the whole model placed
by accelerate (``--device-map``, ini keys ``layerparity_max_memory`` and
``layerparity_offload_folder``); and the report of where it went."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..model.build import model_class_for, own_config
from ..model.devices import free_memory
from ..model.source import ModelSource
from ..options import parse_max_memory
from .plan import Plan, make_plan

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from ..options import Settings


def choose_device_map(settings: Settings, model: ModelSource, dtype_name: str, golden_device: str) -> str:
    """``--device-map``, else the whole model on the golden device when it fits, else ``stream``."""
    if settings.device_map:
        return settings.device_map
    plan = make_plan(model, dtype_name, settings.batch_size, settings.seq_len)
    return golden_device if fits_whole(plan, golden_device) else "stream"


def fits_whole(plan: Plan, golden_device: str, headroom: float = 1.2) -> bool:
    """Would the whole model (and one forward) fit the golden device?"""
    device = golden_device if ":" in golden_device or golden_device == "cpu" else "cuda:0"
    free = free_memory().get(device, 0)
    return (plan.weights + plan.activations + plan.kv_cache) * headroom < free


def load_whole_model(
    model: ModelSource, settings: Settings, dtype: torch.dtype, device_map: str
) -> tuple[PreTrainedModel, dict[str, Any] | None]:
    """The whole model placed by accelerate, and its device map (None when not split)."""
    model_cls = model_class_for(model.hf_config, model.trust_remote_code)
    kwargs: dict[str, Any] = {}
    if settings.max_memory:
        kwargs["max_memory"] = parse_max_memory(settings.max_memory)
    if settings.offload_folder:
        kwargs["offload_folder"] = settings.offload_folder
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers' own load bars would open the session before its header
    try:
        loaded = model_cls.from_pretrained(
            str(model.model_dir),
            config=own_config(model_cls, model.hf_config),
            dtype=dtype,
            device_map=device_map,
            trust_remote_code=model.trust_remote_code,
            **kwargs,
        ).eval()
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return loaded, getattr(loaded, "hf_device_map", None)


def input_device(model: PreTrainedModel) -> torch.device:
    """Where the model's token ids go: the device of its input embeddings."""
    embeddings = model.get_input_embeddings()
    for param in embeddings.parameters():
        if param.device.type != "meta":
            return param.device
    return next(p.device for p in model.parameters() if p.device.type != "meta")


def placement_summary(placement: dict[str, Any] | None, device_map: str, golden_device: str) -> str:
    """Where the reference model went: modules per device, and memory in use on each CUDA
    device (the seeds' multi-GPU report)."""
    if not placement:
        return f"{device_map} on {golden_device}" if device_map == "stream" else str(device_map)
    counts: dict[str, int] = {}
    for device in placement.values():
        key = device if isinstance(device, str) else f"cuda:{device}"
        counts[key] = counts.get(key, 0) + 1
    parts = []
    for device, count in sorted(counts.items()):
        text = f"{device}: {count} modules"
        if device.startswith("cuda"):
            import torch

            index = int(device.split(":")[1]) if ":" in device else 0
            text += (
                f", {torch.cuda.memory_allocated(index) / 1e9:.2f} GB allocated, "
                f"{torch.cuda.memory_reserved(index) / 1e9:.2f} GB reserved"
            )
        parts.append(text)
    return "; ".join(parts)
