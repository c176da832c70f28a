"""A correct port for bench_trained.py, which copies it in as a conftest.py: the model's own
layer, returned by the build hook as a port's would be. The layers under test are then a port's,
which a same-device control can be held beside (``compare.envelope.CONTROLLED_REACH``)."""

from __future__ import annotations


def pytest_layerparity_build_target_layer(layer_idx, reference_layer, model_config, device):
    return reference_layer.to(device)
