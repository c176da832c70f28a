"""The whole model on the target: the prompt, then the golden's decode tokens one at a time
with the target's own KV cache (teacher forcing, as NxDI's logit matching does), giving the
next-token logits of every position. The reference's perturbed runs use the same procedure.

A target model is a *step function*: ``step(input_ids, past) -> (logits, past)``, called
first with the prompt and ``past=None``, then with each decode token (shape [batch, 1]) and
the ``past`` it returned last; ``past`` is whatever the port keeps (a transformers Cache, its
own KV cache manager's state). ``pytest_layerparity_build_target_model`` returns one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .source import ModelSource

StepFn = Callable[[Any, Any], tuple[Any, Any]]


def hf_step(model: torch.nn.Module) -> StepFn:
    """The step function of a transformers causal LM (its own DynamicCache as ``past``,
    passed under the name its forward takes). A decode step feeds the model what its
    generate would (:func:`step_input_ids`): the new token, or the whole sequence so far to a
    model whose forward slices the cached part off itself."""
    import torch

    from ..store.callspec import cache_argument, returned_cache

    name = cache_argument(model.forward, "past_key_values")
    sequence: torch.Tensor | None = None

    def step(input_ids: torch.Tensor, past: Any) -> tuple[torch.Tensor, Any]:
        nonlocal sequence
        fed = input_ids
        ids = input_ids.to("cpu")  # token ids are small: on a lazy device each look at them would be a graph
        if past is None or sequence is None:
            sequence = ids
        else:
            sequence = torch.cat([sequence, ids], dim=-1)
            prepared = step_input_ids(model, sequence, past, name)
            fed = input_ids if prepared.shape == ids.shape else prepared.to(input_ids.device)
        output = model(input_ids=fed, **{name: past}, use_cache=True)
        logits = output.logits if fed is input_ids else output.logits[:, -input_ids.shape[-1] :]
        return logits, returned_cache(output)

    return step


def step_input_ids(model: torch.nn.Module, sequence: torch.Tensor, past: Any, name: str) -> torch.Tensor:
    """The input ids of a decode step whose new token ends ``sequence`` (the prompt and every
    token since), as transformers' generate hands them to ``model``: what its
    ``prepare_inputs_for_generation`` gives for the whole sequence, the cache ``past`` and one
    new token. Most models take the new token alone; CPM-Ant's forward takes the whole
    sequence and slices off the cached part itself. The new token alone where the model's
    preparation gives no input ids that end the sequence."""
    import torch

    from ..store.callspec import cache_argument

    token = sequence[:, -1:]
    prepare = getattr(model, "prepare_inputs_for_generation", None)
    if prepare is None:
        return token
    try:
        prepared = prepare(
            sequence, next_sequence_length=1, **{cache_argument(prepare, name) or name: past}, use_cache=True
        )
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, RuntimeError):
        return token  # a preparation that takes other arguments (a model's own code)
    ids = prepared.get("input_ids") if isinstance(prepared, Mapping) else None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or not 0 < ids.shape[-1] <= sequence.shape[-1]:
        return token
    ids = ids.to(sequence.device)  # a preparation may put them where the cache is (a GPU)
    if ids.shape[0] != sequence.shape[0] or not torch.equal(ids, sequence[:, -ids.shape[-1] :]):
        return token
    return ids


def teacher_forced(
    step: StepFn, prompt_ids: torch.Tensor, decode_ids: torch.Tensor | None, device: Any = None
) -> torch.Tensor:
    """The logits [batch, prompt + decode tokens, vocab] (float32, on the CPU) of the prompt
    and of each decode token fed in turn (``decode_ids`` [batch, N]) through ``step``."""
    import torch

    with torch.no_grad():
        logits, past = step(prompt_ids.to(device) if device is not None else prompt_ids, None)
        out = [logits.detach().to("cpu", torch.float32)]
        for s in range(decode_ids.shape[-1] if decode_ids is not None else 0):
            assert decode_ids is not None
            token = decode_ids[:, s : s + 1]
            logits, past = step(token.to(device) if device is not None else token, past)
            out.append(logits.detach().to("cpu", torch.float32))
    return torch.cat(out, dim=1)


def default_target_model(
    model: ModelSource,
    dtype: torch.dtype,
    device: Any,
    sync: Callable[[], None] | None = None,
    build_layer: Callable[..., Any] | None = None,
) -> StepFn:
    """The model's own transformers implementation, in ``dtype``, moved to ``device``, with
    each decoder layer replaced by the port's (``build_layer``, the
    ``pytest_layerparity_build_target_layer`` hook, where it returns one): the whole model is
    then the port assembled from the layers the layer tests judged. ``sync`` (a lazy device's
    graph cut) runs after each decoder layer: each layer is then a graph of its own, compiled
    once and reused by every layer of the same shape, where the whole forward as one graph took
    minutes to compile on torch-xla's CPU device."""
    from transformers.utils import logging as hf_logging

    from .build import model_class_for, own_config

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        cls = model_class_for(model.hf_config, model.trust_remote_code)
        loaded = cls.from_pretrained(
            str(model.model_dir),
            config=own_config(cls, model.layer_config),
            dtype=dtype,
            trust_remote_code=model.trust_remote_code,
        )
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    layers = loaded.get_submodule(model.layer_list[0])
    if build_layer is not None:
        for index, layer in enumerate(layers):
            port = build_layer(layer_idx=index, reference_layer=layer, model_config=model.layer_config, device=device)
            if port is not None:
                # the model's forward reads some layer attributes (transformers 4.57+: the
                # ``attention_type`` that picks a layer's mask, full or sliding)
                if hasattr(layer, "attention_type") and not hasattr(port, "attention_type"):
                    port.attention_type = layer.attention_type
                layers[index] = port
    loaded = loaded.eval().to(device)
    if sync is not None:
        cut_graphs_at_layers(layers, sync, model.top_k)
    return hf_step(loaded)


def cut_graphs_at_layers(layers: torch.nn.ModuleList, sync: Callable[[], None], top_k: int | None) -> None:
    """On a lazy device, make each decoder layer a graph of its own and the same graph a layer
    test runs, so the whole model compiles nothing the layer tests compiled: a cut before the
    first layer (the embedding, rotary tables and masks are a graph apart, and every layer's
    inputs are device data), and each layer run as the tests run it (its routers' records kept,
    then the sync)."""
    from contextlib import ExitStack

    from ..capture.router_hooks import capture_routing

    layers[0].register_forward_pre_hook(lambda *_: sync())
    open_captures: dict[int, ExitStack] = {}

    def enter(module: torch.nn.Module, args: Any) -> None:
        stack = ExitStack()
        stack.enter_context(capture_routing(module, top_k, {}))  # the records only keep the graph the tests'
        open_captures[id(module)] = stack

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        sync()
        open_captures.pop(id(module)).close()

    for layer in layers:
        layer.register_forward_pre_hook(enter)
        layer.register_forward_hook(leave)
