"""``--plan``'s text: the memory plan (:mod:`.plan`) against each device's free memory, for
each way the reference model can be placed."""

from __future__ import annotations

import dataclasses
import os

from ..model.devices import free_memory
from ..model.source import ModelSource
from .plan import RUN_OVERHEAD, RunOptions, make_plan, stream_extraction_needs


def imported_code_bytes(model: ModelSource) -> int:
    """The memory the run's imports add beyond torch and transformers (the model's modeling
    code, accelerate): measured, by importing them in this process now."""
    import torch  # noqa: F401
    import transformers

    before = _process_rss()
    try:
        import accelerate  # noqa: F401
        import transformers.core_model_loading  # noqa: F401  (the loader a layer loads through)

        from ..model.build import model_class_for

        model_class_for(model.hf_config, model.trust_remote_code)
    except Exception:  # a model whose code cannot be imported here: nothing counted
        return 0
    return max(_process_rss() - before, 0)


def _process_rss() -> int:
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def plan_lines(
    model: ModelSource,
    dtype_name: str,
    batch: int,
    seq: int,
    golden_device: str,
    options: RunOptions | None = None,
) -> list[str]:
    options = options or RunOptions()
    # measured first: the plan itself imports the model's code (its loader's conversions)
    code = imported_code_bytes(model) if golden_device == "cpu" else 0
    plan = make_plan(model, dtype_name, batch, seq)
    free = free_memory()
    gpus = [d for d in free if d.startswith("cuda")]
    need_whole = plan.weights + plan.activations + plan.kv_cache + plan.logits
    target = golden_device if golden_device != "cuda" else "cuda:0"
    options = dataclasses.replace(options, logits_mapped=target == "cpu")
    phase, stream = stream_extraction_needs(plan, model.config_json, dtype_name, batch, seq, options)
    data_stream = sum(stream.values())
    need_stream = data_stream + RUN_OVERHEAD + code
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
    lines.append(
        f"    --device-map stream on {target}: needs {gb(need_stream)}: {_fits(need_stream, free.get(target, 0))}"
    )
    lines.append(f"      tensors the run allocates, at its peak in {phase}: {gb(data_stream)}")
    lines += [f"        {what}: {gb(n)}" for what, n in stream.items() if n]
    lines.append(
        f"      beside them, the run's own (the allocator's free lists and threads' heaps, Python objects; "
        f"measured): {gb(RUN_OVERHEAD)}"
    )
    if options.logits_mapped and plan.logits:
        mapped = gb(plan.logits)
        lines.append(f"      beside them, the prompt's logits in a file-backed map (written out as needed): {mapped}")
    if code:
        lines.append(
            f"      the model's code and accelerate, beyond torch and transformers (measured here): {gb(code)}"
        )
    return lines


def _fits(need: int, free: float) -> str:
    return "fits" if need * 1.2 < free else "does not fit"
