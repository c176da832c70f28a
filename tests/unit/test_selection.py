from __future__ import annotations

import pytest

from pytest_layerparity.selection import (
    LayerRange,
    SelectionError,
    case_order,
    contiguous_runs,
    layer_key,
    parse_layer_key,
    parse_layer_ranges,
    parse_layers,
)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("17", [17]),
        ("0-3", [0, 1, 2, 3]),
        ("0-2,10,20-21", [0, 1, 2, 10, 20, 21]),
        ("5,1-2,2", [1, 2, 5]),
        (" 3 - 4 ", [3, 4]),
        ("all", list(range(62))),
        ("ALL", list(range(62))),
        ("61", [61]),
    ],
)
def test_parse_layers(spec, expected):
    assert parse_layers(spec, 62) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("62", "--layers '62': layer 62 is out of range; this model has 62 layers: valid layers are 0-61"),
        ("5-2", "--layers '5-2': range 5-2 is reversed; write 2-5"),
        (
            "a",
            "--layers 'a': cannot read 'a'; use forms like 17, 0-30, 0-5,10,20-25 or all (this model has 62 layers: "
            "valid layers are 0-61)",
        ),
        ("1,,2", "--layers '1,,2': cannot read ''"),
        ("-1", "--layers '-1': cannot read '-1'"),
        ("", "--layers is empty"),
        ("0-99", "--layers '0-99': layer 99 is out of range"),
        (
            "70-2",
            "--layers '70-2': range 70-2 is reversed, and layer 70 is out of range; this model has 62 layers: "
            "valid layers are 0-61; write 2-61",
        ),
        (
            "70-61",
            "--layers '70-61': range 70-61 is reversed, and layer 70 is out of range; this model has 62 layers: "
            "valid layers are 0-61; write 61",
        ),
        (
            "90-70",
            "--layers '90-70': range 90-70 is reversed, and layer 90 is out of range; this model has 62 layers: "
            "valid layers are 0-61",
        ),
    ],
)
def test_parse_layers_errors(spec, message):
    with pytest.raises(SelectionError) as info:
        parse_layers(spec, 62)
    assert str(info.value).startswith(message)


def test_parse_layer_ranges_keeps_order_and_ids():
    ranges = parse_layer_ranges("6-11,0-5,3", 12)
    assert ranges == [LayerRange(6, 11), LayerRange(0, 5), LayerRange(3, 3)]
    assert [r.id for r in ranges] == ["layers_6-11", "layers_0-5", "layers_3-3"]
    assert parse_layer_ranges("all", 4) == [LayerRange(0, 3)]
    with pytest.raises(SelectionError, match="--layer-ranges '0-12': layer 12 is out of range"):
        parse_layer_ranges("0-12", 12)


@pytest.mark.parametrize(
    ("key", "index"),
    [("layer_0", 0), ("layer_17", 17), ("layer_007", 7), ("model_io", None), ("layers_0-5", None), ("layer_x", None)],
)
def test_layer_keys(key, index):
    assert parse_layer_key(key) == index
    if index is not None:
        assert parse_layer_key(layer_key(index)) == index


def test_case_order_sorts_by_layer_number():
    ids = ["t[layer_10]", "t[layer_9]", "chain[layers_10-12]", "chain[layers_2-3]", "t[layer_0]"]
    assert sorted(ids, key=case_order) == [
        "chain[layers_2-3]",
        "chain[layers_10-12]",
        "t[layer_0]",
        "t[layer_9]",
        "t[layer_10]",
    ]


@pytest.mark.parametrize(
    ("layers", "runs"),
    [([], []), ([3], ["layers_3-3"]), ([0, 1, 2, 5, 6, 9], ["layers_0-2", "layers_5-6", "layers_9-9"])],
)
def test_contiguous_runs(layers, runs):
    assert [r.id for r in contiguous_runs(layers)] == runs
