"""Hooks a project implements in its conftest.py."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.hookspec(firstresult=True)
def pytest_layerparity_build_target_layer(layer_idx: int, reference_layer: Any, model_config: Any, device: Any) -> Any:
    """Return the ``torch.nn.Module`` to test as decoder layer ``layer_idx`` on ``device``.

    ``reference_layer`` is the model's own decoder layer with that layer's weights loaded
    from the checkpoint (on the CPU, in the golden's dtype); it is yours to move, wrap or
    convert. ``model_config`` is the HuggingFace config. The returned module is called with
    exactly the arguments the reference layer received during extraction, with tensors on
    ``device``, and returns what the reference layer returns (the whole-model test runs it in
    the model's own loop); its first output tensor is compared with the golden output. A
    module that cannot take the call, holds weights on another device, or returns another
    kind of output fails the tests that use it, naming this hook, the layer and the fix.

    Return None to fall through to the default (the reference layer moved to ``device``).
    This is where a port such as ``NeuronMiniMaxM2DecoderLayer`` is plugged in.
    """


@pytest.hookspec(firstresult=True)
def pytest_layerparity_build_target_model(model_config: Any, device: Any, settings: Any) -> Any:
    """Return the whole model under test on ``device``, as a step function
    ``step(input_ids, past) -> (logits, past)`` (see ``pytest_layerparity.model.steps``):
    called with the prompt's token ids and ``past=None``, then with each decode token
    ([batch, 1]) and the ``past`` it returned last (your own KV cache state), returning the
    next-token logits of every position it was given. ``settings`` are the session's options.

    Return None to fall through to the default: the model's own transformers implementation
    in the golden's dtype, on ``device``, with each decoder layer that
    ``pytest_layerparity_build_target_layer`` returns put in place of the model's own.
    """


@pytest.hookspec(firstresult=True)
def pytest_layerparity_nxdi_build_module(settings: Any) -> Any:
    """Return the function that compiles each layer's program under ``--port nxdi --target
    neuron``, with the signature and contract of neuronx-distributed-inference's
    ``neuronx_distributed_inference.utils.testing.build_module`` (module class, one tuple of
    example inputs, init kwargs, ``tp_degree``, ``compiler_args``, ``compiler_workdir``,
    ``checkpoint_path``, ``priority_model_idx`` (0 for token generation, None for context
    encoding), ``logical_nc_config`` (the layer's NeuronConfig's); it returns a module called with
    tensors of the example inputs' shapes). ``settings`` are the session's options.

    Return None for NxDI's own ``build_module`` (which needs the Neuron SDK).
    """
