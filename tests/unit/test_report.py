"""Table tests of what people and CI read: the reported fields, JUnit properties, failure
text, the summary table and the report files; and the next-step commands."""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest
import torch

from pytest_layerparity.compare.judge import judge, judge_golden
from pytest_layerparity.compare.metrics import METRIC_NAMES
from pytest_layerparity.options import make_settings
from pytest_layerparity.report.entry import ReportEntry
from pytest_layerparity.report.fields import CSV_COLUMNS, FIELD_NAMES, FIELDS, PLOTTED, SUMMARY_COLUMNS
from pytest_layerparity.report.files import YScale, isolated_layer, write_reports, y_scale
from pytest_layerparity.report.properties import properties, reported_metrics
from pytest_layerparity.report.text import failure_text, first_failing, summary_lines
from pytest_layerparity.store.commands import Commands, extract_command, extraction_flags, rerun_command


def outcome_of(scale: float, layer: int = 2):
    gen = torch.Generator().manual_seed(layer)
    x = torch.randn(1, 6, 8, generator=gen, dtype=torch.float64)
    ref = x + torch.randn(1, 6, 8, generator=gen, dtype=torch.float64)
    golden = (ref + 1e-4 * torch.randn(1, 6, 8, generator=gen, dtype=torch.float64)).float()
    target = golden + scale * (ref - x).float()
    return judge(layer, golden, target, make_settings(), "float32", floor=ref, hidden_in=x.float())


# -- the fields table ---------------------------------------------------------------------------


def test_the_five_metrics_come_first_in_their_order():
    assert FIELD_NAMES[:5] == METRIC_NAMES
    assert len(set(FIELD_NAMES)) == len(FIELD_NAMES)


def test_derived_lists_follow_the_table():
    assert ("nodeid", "layers", "verdict", *(f.name for f in FIELDS if f.csv)) == CSV_COLUMNS
    assert set(PLOTTED) <= set(FIELD_NAMES)
    assert [title for title, _, _ in SUMMARY_COLUMNS] == [
        "max_abs_diff",
        "mean_abs_diff",
        "cosine",
        "pearson",
        "similar%",
        "noise_ratio",
        "token_ratio",
        "routing",
    ]


# -- properties ---------------------------------------------------------------------------------


def test_properties_carry_every_metric_and_the_floor_statistics():
    outcome = outcome_of(0.0)
    props = dict(properties(outcome))
    for name in (*METRIC_NAMES, "nan_count", "inf_count", "has_nan", "has_inf", "worst_index", "noise_ratio"):
        assert name in props, name
    assert props["has_nan"] is False and props["nan_count"] == 0
    assert props["noise_ratio"] == outcome.floor.noise_ratio
    assert props["contribution_bias"] == outcome.floor.contribution_z + outcome.floor.golden_contribution_z
    assert "routing_agreement" not in props  # no routers


def test_prefixed_properties_for_chains():
    names = [name for name, _ in properties(outcome_of(0.0), prefix="layer_4.")]
    assert names and all(name.startswith("layer_4.") for name in names)


def test_routing_properties():
    golden = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    tensors = {
        "output": golden,
        "routing.gate.indices": torch.tensor([[0, 1], [2, 3], [0, 3]]),
        "routing.gate.logits": torch.tensor([[5.0, 4.0, 0.0, 0.0], [0.0, 0.0, 5.0, 4.0], [5.0, 0.0, 0.0, 4.0]]),
    }
    target_routing = {"routing.gate.indices": torch.tensor([[0, 1], [2, 3], [0, 1]])}
    outcome = judge_golden(0, tensors, "output", golden, target_routing, make_settings(), "bfloat16")
    props = dict(properties(outcome))
    assert props["routing_agreement"] == pytest.approx(2 / 3)
    assert (props["routing_flipped"], props["routing_near_tie_flipped"]) == (1, 0)


def test_reported_metrics_keep_known_fields_only():
    props = {"max_abs_diff": 1.0, "layers": "3", "verdict": "pass", "layer_3.noise_ratio": 2.0, "noise_ratio": 1.1}
    assert reported_metrics(props) == {"max_abs_diff": 1.0, "noise_ratio": 1.1}


# -- failure text ---------------------------------------------------------------------------------


def test_failure_text_says_everything_a_failing_layer_should():
    outcome = outcome_of(0.01)
    assert not outcome.passed
    text = failure_text(outcome, "on xla:0", "pytest --xla -k layer_2 --op-compare")
    lines = text.splitlines()
    assert lines[0] == "layer 2 on xla:0: output differs from the golden"
    assert lines[1] == "  shape (1, 6, 8), golden float32, target float32"
    assert lines[2].split() == ["metric", "value", "threshold"]
    rows = lines[3 : 3 + len(outcome.checks)]
    assert [row.split()[0] for row in rows] == [c.name for c in outcome.checks]
    assert [row.split()[-1] for row in rows] == ["ok" if c.ok else "FAIL" for c in outcome.checks]
    assert lines[3 + len(outcome.checks)].startswith("  worst element: index (0, ")
    assert any(line.startswith("  precision floor: ||golden - ref|| = ") for line in lines)
    assert any(
        line.startswith("  minimum passing tolerance: atol ") and "-o layerparity_max_noise_ratio=" in line
        for line in lines
    )
    assert lines[-1] == "  drill in: pytest --xla -k layer_2 --op-compare"


# -- summary and files ----------------------------------------------------------------------------


def entries():
    def entry(layers: str, verdict: str, **metrics):
        return ReportEntry(
            nodeid=f"layerparity::test_layer_parity[layer_{layers}]",
            layers=layers,
            verdict=verdict,
            metrics=metrics,
            message="" if verdict == "pass" else "layer failed\n  details",
        )

    return [
        entry("0", "pass", max_abs_diff=1e-6, cosine_similarity=1.0, noise_ratio=1.01),
        entry("1", "fail", max_abs_diff=0.5, cosine_similarity=0.9, noise_ratio=300.0),
        dataclasses.replace(entry("2", "error"), nodeid="layerparity::test_layer_parity[layer_2]"),
        dataclasses.replace(entry("0-2", "fail", noise_ratio=5.0), nodeid="layerparity::test_chain_parity[layers_0-2]"),
    ]


def test_summary_lines():
    lines = summary_lines(entries())
    assert lines[0].split() == ["test", "verdict", *(title for title, _, _ in SUMMARY_COLUMNS)]
    assert lines[1].split()[:4] == ["test_layer_parity[layer_0]", "pass", "1e-06", "-"]
    assert lines[2].split()[:2] == ["test_layer_parity[layer_1]", "fail"]
    assert lines[-1] == "first failing: test_layer_parity[layer_1] (layers 1)"
    assert summary_lines([]) == []


def test_a_test_that_judged_nothing_is_counted_as_skipped_with_its_reason():
    skipped = ReportEntry(
        nodeid="layerparity::test_layer_decode_parity[layer_3]",
        layers="3",
        verdict="skipped",
        metrics={},
        message="layer 3, decode step 0: not judged: every one of its 1 token(s) routed ...",
    )
    lines = summary_lines([skipped])
    assert lines[1].split()[:2] == ["test_layer_decode_parity[layer_3]", "skipped"]
    assert lines[2] == "  layer 3, decode step 0: not judged: every one of its 1 token(s) routed ..."
    assert not any(line.startswith("first failing") for line in lines)


def test_the_whole_model_row_is_followed_by_its_own_metrics():
    model = ReportEntry(
        nodeid="layerparity::test_model_parity",
        layers="model",
        verdict="pass",
        metrics={
            "top1_agreement": 0.875,
            "near_tie_flips": 2,
            "greedy_flips_outside_ties": 0,
            "kl_divergence": 6.2e-5,
            "kl_divergence_limit": 1e-3,
            "generated": 3,
            "generated_matched": 1,
        },
    )
    lines = summary_lines([model])
    assert lines[1].split()[:2] == ["test_model_parity", "pass"]
    assert lines[2] == (
        "  top-1 agreement 0.875 (2 near-tie flips, 0 others), KL median 6.2e-05 (limit 0.001), "
        "greedy tokens before divergence 1/3"
    )


def test_first_failing_is_the_lowest_isolated_layer_then_chains_then_the_model():
    def named(name, layers, verdict="fail"):
        return ReportEntry(nodeid=f"layerparity::{name}", layers=layers, verdict=verdict, metrics={})

    decode3 = named("test_layer_decode_parity[layer_3]", "3")
    prompt3 = named("test_layer_parity[layer_3]", "3")
    chain = named("test_chain_parity[layers_0-5]", "0-5")
    model = named("test_model_parity", "model")
    assert first_failing([model, chain, decode3, prompt3]) is prompt3
    assert first_failing([model, chain, decode3]) is decode3
    assert first_failing([model, chain]) is chain
    assert first_failing([model, named("test_layer_parity[layer_0]", "0", "pass")]) is model
    assert first_failing([named("test_layer_parity[layer_0]", "0", "pass")]) is None


@pytest.mark.parametrize(("layers", "expected"), [("3", 3), ("0-2", None), ("", None), ("12", 12)])
def test_isolated_layer(layers, expected):
    assert isolated_layer(ReportEntry(nodeid="", layers=layers, verdict="pass")) == expected


def test_report_files(tmp_path):
    paths = write_reports(tmp_path, entries(), header=["layerparity: target xla, dtype float32"])
    assert [p.name for p in paths] == ["report.json", "report.csv", "report.html"]
    data = json.loads((tmp_path / "report.json").read_text())
    assert [t["layers"] for t in data["tests"]] == ["0", "1", "2", "0-2"]
    with open(tmp_path / "report.csv", newline="") as handle:
        rows = list(csv.reader(handle))
    assert tuple(rows[0]) == CSV_COLUMNS and len(rows) == 5
    assert rows[2][:3] == ["layerparity::test_layer_parity[layer_1]", "1", "fail"]
    page = (tmp_path / "report.html").read_text()
    assert page.count("<tr class='pass'>") == 1 and page.count("<tr class='fail'>") == 3
    assert "<div class='table-box'><table><tr><th>test</th>" in page  # the table scrolls in its own box
    assert (
        "<img alt='metrics across layers; y axes: max_abs_diff (log), 1 - cosine_similarity (log), noise_ratio (log)' "
        in page
    )
    assert "First failing: test_layer_parity[layer_1] (layers 1)" in page
    assert "layerparity: target xla, dtype float32" in page


def test_the_compare_command_says_why_there_is_nothing_to_compare(tmp_path, capsys):
    from pytest_layerparity.__main__ import main
    from pytest_layerparity.offline import NothingToCompare, compare_stores
    from pytest_layerparity.store.golden import GoldenStore

    golden, target, missing = tmp_path / "golden", tmp_path / "target", tmp_path / "missing"
    for store in (golden, target):
        GoldenStore(store).begin({"dtype": "float32"}, compare_keys=("dtype",))
    cases = [
        (missing, target, "layer_*", f"{missing} is not a golden store (no manifest.json)"),
        (
            golden,
            missing,
            "layer_*",
            f"{missing} is not a store of outputs (no manifest.json); write one with --save-outputs",
        ),
        (golden, target, "layer_9", f"no layer matches 'layer_9' in both {golden} and {target}"),
    ]
    for golden_dir, target_dir, pattern, why in cases:
        with pytest.raises(NothingToCompare) as raised:
            compare_stores(str(golden_dir), str(target_dir), pattern, make_settings())
        assert str(raised.value) == why
        assert main(["compare", str(golden_dir), str(target_dir), "--layer-pattern", pattern]) == 1
        assert capsys.readouterr() == ("", f"error: {why}\n")


# -- commands ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        (("/g",), {}, "pytest --gpu-golden --extract --golden-dir=/g"),
        (("/g", "/m"), {}, "pytest --gpu-golden --extract --model=/m --golden-dir=/g"),
        (("/g", "/m", "3"), {}, "pytest --gpu-golden --extract --model=/m --golden-dir=/g --layers 3"),
        (
            ("/my goldens", "/my model"),
            {},
            "pytest --gpu-golden --extract '--model=/my model' '--golden-dir=/my goldens'",
        ),
        (
            ("/g", "/m"),
            {"dtype": "bfloat16"},
            "pytest --gpu-golden --extract --model=/m --golden-dir=/g --dtype bfloat16",
        ),
        (
            ("/g", "/m", "0-3"),
            {"dtype": "float32", "flags": ("--dtype", "bfloat16", "--seq-len", "64")},
            "pytest --gpu-golden --extract --model=/m --golden-dir=/g --dtype float32 --seq-len 64 --layers 0-3",
        ),
        (
            ("/g", "/m"),
            {"flags": ("--prompt", "Hello there"), "force_regen": True},
            "pytest --gpu-golden --extract --model=/m --golden-dir=/g --prompt 'Hello there' --force-regen",
        ),
    ],
)
def test_extract_command(args, kwargs, expected):
    assert extract_command(*args, **kwargs) == expected


RANDOM_INPUTS = {"source": "random", "prompt": None, "seed": 0, "batch_size": 1, "seq_len": 32, "decode_steps": 2}


@pytest.mark.parametrize(
    ("header", "default_dtype", "flags"),
    [
        ({"dtype": "bfloat16", "inputs": RANDOM_INPUTS, "envelope": {"runs": 12}}, "bfloat16", ()),
        ({"dtype": "float32", "inputs": RANDOM_INPUTS, "envelope": {"runs": 12}}, "bfloat16", ("--dtype", "float32")),
        ({"dtype": "int8", "inputs": RANDOM_INPUTS}, "bfloat16", ()),  # not a dtype a command can ask for
        (
            {"dtype": "bfloat16", "inputs": {**RANDOM_INPUTS, "seq_len": 600, "batch_size": 2, "seed": 7}},
            "bfloat16",
            ("--seq-len", "600", "--batch-size", "2", "-o", "layerparity_seed=7"),
        ),
        (
            {"dtype": "bfloat16", "inputs": {**RANDOM_INPUTS, "decode_steps": 0}, "envelope": {"runs": 0}},
            "bfloat16",
            ("--decode-steps", "0", "--envelope-samples", "0"),
        ),
        (
            {"inputs": {"source": "prompt", "prompt": "Hi", "seed": None, "seq_len": None, "decode_steps": 2}},
            None,
            ("--prompt", "Hi"),
        ),
        ({}, None, ()),
    ],
)
def test_extraction_flags_repeat_what_differs_from_the_defaults(header, default_dtype, flags):
    assert extraction_flags(header, default_dtype) == flags


def test_extraction_flags_leave_out_exactly_the_options_defaults():
    from pytest_layerparity.options import make_settings
    from pytest_layerparity.reference.inputs import input_description

    settings = make_settings()
    header = {
        "dtype": "float16",
        "inputs": input_description(settings),
        "envelope": {"runs": settings.envelope_samples},
    }
    assert extraction_flags(header, "float16") == ()


@pytest.mark.parametrize(
    ("target", "flags"),
    [("xla", "--xla"), ("neuron", "--neuron"), ("cpu", "--target cpu"), ("cuda", "--target cuda"), (None, "--xla")],
)
def test_rerun_command(target, flags):
    assert rerun_command(target, "/m", "/g", "5", "layer_5") == (
        f"pytest {flags} --model=/m --golden-dir=/g --layers 5 -k layer_5 --op-compare -vv"
    )


def test_rerun_command_keeps_the_port():
    port = ("--port", "nxdi", "-o", "layerparity_nxdi_app=p.m:C")
    assert rerun_command("cpu", "/m", "/g", "1", "layer_1", port) == (
        "pytest --target cpu --port nxdi -o layerparity_nxdi_app=p.m:C --model=/m --golden-dir=/g --layers 1 "
        "-k layer_1 --op-compare -vv"
    )


def test_commands_of_a_session():
    commands = Commands("/g", "/m", "neuron")
    assert commands.extract("2") == "pytest --gpu-golden --extract --model=/m --golden-dir=/g --layers 2"
    assert commands.rerun("2", "layer_2") == rerun_command("neuron", "/m", "/g", "2", "layer_2")


def test_plot_panels_show_the_envelope_failures_and_one_minus_cosine_on_a_log_axis():
    from pytest_layerparity.report.files import panels, plot_png

    rows = entries()
    rows[0].metrics.update(
        noise_ratio_limit=1.6, contribution_bias=-1.0, contribution_bias_low=-9.0, contribution_bias_high=8.0
    )
    rows[1].metrics.update(noise_ratio_limit=1.7)
    drawn = {p.label: p for p in panels(rows)}
    assert set(drawn) == {"max_abs_diff", "1 - cosine_similarity", "noise_ratio", "contribution_bias"}
    cosine = drawn["1 - cosine_similarity"]
    assert cosine.scale == YScale("log") and cosine.points == [(0, 1e-16), (1, pytest.approx(0.1))]
    assert drawn["noise_ratio"].band == [(0, 0.0, 1.6), (1, 0.0, 1.7)]  # the chain's entry (0-2) is not a layer
    assert drawn["contribution_bias"].band == [(0, -9.0, 8.0)] and drawn["contribution_bias"].scale == YScale("linear")
    assert drawn["noise_ratio"].scale == YScale("log")  # 300 against 1.01: the envelope would lie flat on a linear axis
    assert drawn["noise_ratio"].failing == [(1, 300.0)]
    png = plot_png(rows)
    assert png is not None and png.startswith(b"\x89PNG")
    assert panels([rows[3]]) == [] and plot_png([rows[3]]) is None


def test_plot_panels_draw_chained_drift_beside_isolated_and_leave_decode_steps_out():
    from pytest_layerparity.report.files import panels, plot_png

    rows = entries()[:2]
    chain = ReportEntry(
        nodeid="layerparity::test_chain_parity[layers_0-1]",
        layers="0-1",
        verdict="pass",
        metrics={"noise_ratio": 1.4},
        properties={"layer_0.noise_ratio": 1.0, "layer_1.noise_ratio": 1.4, "layer_1.cosine_similarity": 0.99},
    )
    decode = ReportEntry(
        nodeid="layerparity::test_layer_decode_parity[layer_0]",
        layers="0",
        verdict="fail",
        metrics={"noise_ratio": 50.0},
    )
    drawn = {p.label: p for p in panels([*rows, chain, decode])}
    assert drawn["noise_ratio"].points == [(0, 1.01), (1, 300.0)]  # the decode test's 50 is not layer 0's prompt
    assert drawn["noise_ratio"].chained == [(0, 1.0), (1, 1.4)]
    assert drawn["1 - cosine_similarity"].chained == [(1, pytest.approx(0.01))]
    assert drawn["noise_ratio"].failing == [(1, 300.0)]
    only_chain = panels([chain])
    assert [p.label for p in only_chain] == ["1 - cosine_similarity", "noise_ratio"] and not only_chain[0].points
    png = plot_png([*rows, chain])
    assert png is not None and png.startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("values", "logarithmic", "expected"),
    [
        ([], False, YScale("linear")),
        ([0.0, 0.0], True, YScale("linear")),
        ([1.0, 1.1, 0.9], False, YScale("linear")),
        ([1.0, 1.1, 0.9, 3.6e5], False, YScale("log")),  # one outlier would flatten the rest
        ([1.0, 100.0], False, YScale("linear")),  # two decades exactly
        ([1.0, 100.5], False, YScale("log")),
        ([1e-6, 1e-3, 2e-3], False, YScale("log")),
        ([0.5, 0.9], True, YScale("log")),  # a log panel (max_abs_diff, 1 - cosine) stays log
        ([1.0, float("nan"), float("inf"), 1.2], False, YScale("linear")),  # non-finite values are not drawn
        ([0.0, 1.0, 1.1, 3.6e5], False, YScale("symlog", 1.1)),  # a zero: linear up to the median
        ([-1.0, 2.0, -3.0, 16.5, -17.9], False, YScale("linear")),  # signed, no outlier
        ([-1.06, -1.5, 4.58e6, -3.28, 16.5, -17.9], False, YScale("symlog", 16.5)),
        ([0.0, 0.17, 0.0], True, YScale("symlog", 0.17)),  # max_abs_diff of bit-identical layers is 0
        ([0.0, 1e-6, 0.5], True, YScale("symlog", 1e-6)),
    ],
)
def test_y_scale(values, logarithmic, expected):
    assert y_scale(values, logarithmic) == expected


def plotted_layer(n: int, noise: float, verdict: str = "pass") -> ReportEntry:
    metrics = {"max_abs_diff": 2959.0 if verdict == "fail" else 0.0, "noise_ratio": noise, "noise_ratio_limit": 1.3}
    return ReportEntry(f"layerparity::test_layer_parity[layer_{n}]", str(n), verdict, metrics)


def test_an_outlier_layer_puts_its_panels_on_log_axes():
    from pytest_layerparity.report.files import panels

    drawn = panels([plotted_layer(1, 1.0), plotted_layer(2, 1.0), plotted_layer(3, 1.17e5, "fail")])
    assert [(p.label, p.scale) for p in drawn] == [
        ("max_abs_diff", YScale("symlog", 2959.0)),  # 0 where the layer is bit-identical
        ("noise_ratio", YScale("log")),  # the envelope (up to 1.3) and the passing layers' 1.0 stay apart
    ]


@pytest.mark.parametrize("layers", [[1, 2, 3, 4], [3], [0, 1], list(range(62))])
def test_the_plot_ticks_whole_layers_and_draws_each_panel_on_its_scale(layers):
    import matplotlib.pyplot as plt

    from pytest_layerparity.report.files import figure, panels

    drawn = panels([plotted_layer(n, 1.17e5 if n == 3 else 1.0, "fail" if n == 3 else "pass") for n in layers])
    fig = figure(drawn)
    try:
        for ax, panel in zip(fig.axes, drawn, strict=True):
            low, high = ax.get_xlim()
            ticks = [t for t in ax.get_xticks() if low <= t <= high]
            assert ticks and all(t == int(t) for t in ticks), ticks  # no layer 0.5
            assert ax.get_yscale() == panel.scale.name
    finally:
        plt.close(fig)
