"""A reference that overflows in its dtype: where its output first holds inf/NaN, and the
error that says so (reference/overflow.py)."""

from __future__ import annotations

import pytest
import torch

from pytest_layerparity.reference.overflow import (
    Measured,
    Overflow,
    OverflowWatch,
    StopForward,
    first_tensor,
    nonfinite_stats,
    output_overflow,
    overflow_text,
)
from pytest_layerparity.store.finite import all_finite_by_sum

INF, NAN = float("inf"), float("nan")
T = torch.tensor([1.0, -2.0])


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (T, T),
        ((T, None), T),
        ((None, [T]), T),
        ({"hidden": T}, T),
        ((None, "x"), None),
    ],
)
def test_first_tensor_is_the_hidden_states(output, expected):
    assert first_tensor(output) is expected


@pytest.mark.parametrize(
    ("values", "dtype", "count", "largest"),
    [
        ([1.0, -3.0, 2.0], torch.float32, 0, 3.0),
        ([1.0, -INF, 2.0], torch.float32, 1, 2.0),
        ([NAN, INF, -5.0, 4.0], torch.bfloat16, 2, 5.0),
        ([70000.0, -60000.0], torch.float16, 1, 60000.0),  # 70000 is inf in float16
        ([NAN, INF], torch.float32, 2, 0.0),
    ],
)
def test_nonfinite_stats(values, dtype, count, largest):
    found, magnitude = nonfinite_stats(torch.tensor(values).to(dtype))
    assert (int(found), float(magnitude)) == (count, largest)


class Scale(torch.nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x * self.factor, None  # a tuple, as a decoder layer may return


def forward(layers: torch.nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)[0]
    return x


@pytest.mark.parametrize(
    ("factors", "first"),
    [
        ([2.0, 3.0, 1.0], None),
        ([2.0, 30000.0, 1.0], Overflow(1, None, 1, 60000.0)),  # 2 x 2 x 30000 = 120000: inf in float16
        ([2.0, 30000.0, 0.0], Overflow(1, None, 1, 60000.0)),  # the first: inf x 0 is NaN at layer 2
        ([INF, 1.0], Overflow(0, None, 2, 0.0)),
    ],
)
def test_the_watch_names_the_first_layer_whose_output_overflows(factors, first):
    layers = torch.nn.ModuleList(Scale(f) for f in factors)
    watch = OverflowWatch()
    with watch.watching(layers):
        forward(layers, torch.tensor([1.0, 2.0], dtype=torch.float16))
    assert watch.first() == first
    assert not any(layer._forward_hooks for layer in layers)


def test_the_watch_labels_decode_steps_and_stops_where_asked():
    layers = torch.nn.ModuleList(Scale(f) for f in (2.0, 3.0, 4.0))
    watch = OverflowWatch()
    with watch.watching(layers):
        forward(layers, torch.ones(2, dtype=torch.float16))
    watch.step = 1
    with watch.watching(layers, stop=1), pytest.raises(StopForward):
        forward(layers, torch.tensor([1.0, INF], dtype=torch.float16))
    assert watch.first() == Overflow(0, 1, 1, 2.0)
    assert watch.largest(1) == 6.0  # the last output of layer 1 noted: the step's
    assert watch.largest(2) == 24.0  # (the prompt's; the step stopped before it)
    assert not any(layer._forward_hooks for layer in layers)


@pytest.mark.parametrize(
    ("values", "step", "expected"),
    [
        ([1.0, 2.0], None, None),
        ([1.0, -INF, NAN], 3, Overflow(None, 3, 2, 1.0)),
    ],
)
def test_output_overflow(values, step, expected):
    assert output_overflow(torch.tensor(values), step, "the logits", all_finite_by_sum) == expected


def command(dtype: str) -> str:
    return f"pytest --gpu-golden --extract --model=/m --golden-dir=/g --dtype {dtype}"


HEAD = "the reference model itself {verb} in {dtype}: first at {where}, whose output holds {what}"
NOT_A_PORT = "This is the HuggingFace model's own forward on the golden input, not a port; no golden was written. "


@pytest.mark.parametrize(
    ("dtype", "found", "measured", "expected"),
    [
        (
            "float16",
            Overflow(1, None, 1468, 65280.0),
            {"bfloat16": Measured(None, 741376.0), "float32": Measured(None, 744932.9)},
            HEAD.format(verb="overflows", dtype="float16", where="layer 1", what="1468 inf/NaN values")
            + " (largest finite magnitude 65280; float16 holds at most 65504). "
            + NOT_A_PORT
            + "Measured through layer 1: bfloat16 does not overflow (largest magnitude 741376), float32 does not "
            "overflow (largest magnitude 744933). Extract in bfloat16: " + command("bfloat16"),
        ),
        (
            "bfloat16",
            Overflow(None, 0, 3, 1.5e38),
            {"float16": Measured(Overflow(0, 0, 9, 60000.0), 0.0), "float32": Measured(None, 3.2e38)},
            HEAD.format(verb="overflows", dtype="bfloat16", where="the logits, decode step 0", what="3 inf/NaN values")
            + " (largest finite magnitude 1.5e+38; bfloat16 holds at most 3.38953e+38). "
            + NOT_A_PORT
            + "Measured through the whole forward, on the prompt and its 1 decoded token(s): float16 overflows too "
            "(at layer 0, decode step 0), float32 does not overflow (largest magnitude 3.2e+38). Extract in float32: "
            + command("float32"),
        ),
        (
            "float16",
            Overflow(0, None, 64, 0.0),
            {
                "bfloat16": Measured(Overflow(0, None, 64, 0.0), 0.0),
                "float32": Measured(Overflow(0, None, 64, 0.0), 0.0),
            },
            HEAD.format(verb="gives inf/NaN", dtype="float16", where="layer 0", what="64 inf/NaN values")
            + " (largest finite magnitude 0; float16 holds at most 65504). "
            + NOT_A_PORT
            + "Measured through layer 0: bfloat16 overflows too (at layer 0), float32 overflows too (at layer 0); the "
            "checkpoint gives inf/NaN in every supported dtype: check its weights and config.json",
        ),
    ],
)
def test_overflow_text(dtype, found, measured, expected):
    assert overflow_text(dtype, found, measured, command) == expected
