"""Table tests of the option parsers and settings (pytest_layerparity.options)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pytest_layerparity.options import (
    OPTIONS,
    Settings,
    boolean,
    check_combinations,
    correlation,
    device_map_choice,
    dtype_name,
    golden_device,
    make_settings,
    max_memory_spec,
    moved_flag_fixes,
    non_negative_int,
    parse_max_memory,
    percentage,
    positive_int,
    resolve_cache_location,
    size_bytes,
    tolerance,
)


@pytest.mark.parametrize(
    ("parse", "text", "value"),
    [
        (positive_int, "32", 32),
        (positive_int, "1", 1),
        (non_negative_int, "0", 0),
        (non_negative_int, "7", 7),
        (tolerance, "0", 0.0),
        (tolerance, "1e-3", 1e-3),
        (percentage, "0", 0.0),
        (percentage, "95.5", 95.5),
        (percentage, "100", 100.0),
        (correlation, "-1", -1.0),
        (correlation, "0.99", 0.99),
        (dtype_name, "bf16", "bfloat16"),
        (dtype_name, " FP16 ", "float16"),
        (dtype_name, "half", "float16"),
        (dtype_name, "float", "float32"),
        (dtype_name, "float32", "float32"),
        (golden_device, "auto", "auto"),
        (golden_device, "CUDA:3", "cuda:3"),
        (golden_device, "cpu", "cpu"),
        (device_map_choice, "stream", "stream"),
        (device_map_choice, " balanced_low_0 ", "balanced_low_0"),
        (device_map_choice, "cuda:1", "cuda:1"),
        (max_memory_spec, "0:60GB,cpu:100GB", "0:60GB,cpu:100GB"),
        (boolean, "true", True),
        (boolean, " Yes ", True),
        (boolean, "1", True),
        (boolean, "False", False),
        (boolean, "off", False),
    ],
)
def test_good_values(parse, text, value):
    assert parse(text) == value


@pytest.mark.parametrize(
    ("parse", "text", "message"),
    [
        (positive_int, "x", "'x' is not a whole number; give a positive integer such as 32"),
        (positive_int, "0", "'0' must be a positive integer (1 or more)"),
        (positive_int, "-3", "'-3' must be a positive integer (1 or more)"),
        (non_negative_int, "1.5", "'1.5' is not a whole number; give 0 or more"),
        (non_negative_int, "-1", "'-1' must be 0 or more"),
        (tolerance, "abc", "'abc' is not a number"),
        (tolerance, "nan", "'nan' is not a finite number"),
        (tolerance, "inf", "'inf' is not a finite number"),
        (tolerance, "-0.1", "'-0.1' is negative; a tolerance is 0 or more (e.g. 0.01)"),
        (percentage, "101", "'101' is not a percentage between 0 and 100 (e.g. 95)"),
        (correlation, "1.5", "'1.5' is not between -1 and 1 (e.g. 0.99)"),
        (dtype_name, "int8", "'int8' is not a supported dtype; choose one of bfloat16, float16, float32"),
        (golden_device, "tpu", "'tpu' is not a golden device; choose auto, cpu, cuda or cuda:N"),
        (boolean, "maybe", "'maybe' is not true or false"),
        (golden_device, "cuda:x", "'cuda:x' is not a golden device; choose auto, cpu, cuda or cuda:N"),
        (
            device_map_choice,
            "everywhere",
            "'everywhere' is not a device map; choose stream, auto, balanced, balanced_low_0, sequential, cpu or "
            "cuda:N",
        ),
        (
            max_memory_spec,
            "lots",
            "'lots' is not a memory budget (lots); accepted forms: 40GB (every GPU), 0:60GB,1:60GB,2:40GB (per GPU), "
            "cpu:100GB (host), units B/KB/MB/GB/TB or KiB/MiB/GiB/TiB",
        ),
    ],
)
def test_bad_values_say_what_to_type(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError) as info:
        parse(text)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("text", "expected"),
    [("40GB", 40 * 10**9), ("1.5 mb", 1_500_000), ("2KiB", 2048), ("3 GiB", 3 * 2**30), ("7B", 7), ("1TB", 10**12)],
)
def test_size_bytes(text, expected):
    assert size_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "40 GiBs", "-1GB", "forty GB"])
def test_size_bytes_refuses(text):
    with pytest.raises(ValueError):
        size_bytes(text)


@pytest.mark.parametrize(
    ("text", "gpus", "expected"),
    [
        ("40GB", 2, {0: "40GB", 1: "40GB"}),
        ("40GB", 0, {"cpu": "40GB"}),
        ("0:60GB,1:60GB,2:40GB", 3, {0: "60GB", 1: "60GB", 2: "40GB"}),
        ("cpu:100GB", 0, {"cpu": "100GB"}),
        (" 0:1GB , cpu:2GB ", 1, {0: "1GB", "cpu": "2GB"}),
    ],
)
def test_parse_max_memory(text, gpus, expected):
    assert parse_max_memory(text, gpus=gpus) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("0:60GB,40GB", "'40GB' has no device; write DEVICE:SIZE"),
        ("gpu0:60GB", "'gpu0' is not a GPU index or cpu"),
        ("0:sixty", "sixty"),
    ],
)
def test_parse_max_memory_refuses(text, message):
    with pytest.raises(ValueError) as info:
        parse_max_memory(text, gpus=1)
    assert str(info.value) == message


def test_make_settings_defaults_are_the_option_table():
    settings = make_settings()
    for opt in OPTIONS:
        if opt.dest != "port":  # decided from the target (below)
            assert getattr(settings, opt.dest) == opt.default, opt.flag
    assert settings.mode is None and settings.target_name is None
    assert settings.port == "hf" and make_settings(neuron=True).port == "nxdi"
    assert make_settings(target="neuron", port="hf").compiled is False


def test_make_settings_refuses_unknown_names():
    with pytest.raises(TypeError, match="unknown settings: nope, other"):
        make_settings(nope=1, other=2)


@pytest.mark.parametrize(
    ("values", "target", "mode"),
    [
        ({}, None, None),
        ({"xla": True}, "xla", "parity"),
        ({"neuron": True}, "neuron", "parity"),
        ({"target": "cuda"}, "cuda", "parity"),
        ({"gpu_golden": True}, None, "verify"),
        ({"gpu_golden": True, "extract": True}, None, "extract"),
        ({"extract": True}, None, None),
    ],
)
def test_mode_and_target(values, target, mode):
    settings = make_settings(**values)
    assert (settings.target_name, settings.mode) == (target, mode)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"xla": True, "neuron": True},
            "--xla and --neuron name different targets; choose one: --xla, --neuron or --target NAME",
        ),
        (
            {"xla": True, "target": "cpu"},
            "--xla and --target cpu name different targets; choose one: --xla, --neuron or --target NAME",
        ),
        ({"extract": True}, "--extract writes goldens from the reference run: use --gpu-golden --extract"),
        (
            {"gpu_golden": True, "xla": True},
            "--gpu-golden runs the reference and --xla the port; run them as two sessions: "
            "pytest --gpu-golden --extract, then pytest --xla",
        ),
        ({"chain": True}, "--chain runs layers on a target: add --xla, --neuron or --target NAME"),
        (
            {"bisect": True, "gpu_golden": True},
            "--bisect runs layers on a target: add --xla, --neuron or --target NAME",
        ),
        (
            {"layer_ranges": "0-1"},
            "--layer-ranges runs layers on a target: add --xla, --neuron or --target NAME",
        ),
        (
            {"xla": True, "ep_degree": 2},
            "layerparity_ep_degree = 2 shards the experts of NxDI's MoE layers: use it with --port nxdi",
        ),
    ],
)
def test_contradictions_are_usage_errors(values, message):
    with pytest.raises(pytest.UsageError) as info:
        check_combinations(make_settings(**values))
    assert str(info.value) == message


@pytest.mark.parametrize("values", [{}, {"xla": True, "chain": True, "bisect": True}, {"gpu_golden": True}])
def test_consistent_settings_pass(values):
    check_combinations(make_settings(**values))


@pytest.mark.parametrize(
    ("value", "expected"),
    [("cache", "/base/cache"), ("/abs/cache", "/abs/cache"), ("s3://bucket/neuron", "s3://bucket/neuron")],
)
def test_cache_locations(value, expected):
    assert resolve_cache_location(value, Path("/base")) == expected


def test_every_option_is_a_setting_and_every_setting_an_option():
    assert {opt.dest for opt in OPTIONS} == set(Settings.__dataclass_fields__)
    flags = [opt.flag for opt in OPTIONS]
    assert len(flags) == len(set(flags))
    for opt in OPTIONS:
        assert (opt.help[0].isupper() or opt.help.startswith("--")) and (
            opt.help.endswith(".") or opt.help.endswith(")")
        ), opt.flag


def test_settings_are_the_option_table_with_plain_values():
    settings = make_settings(xla=True, near_ties="strict", max_contribution_z=320.0, trust_remote_code=True)
    assert list(Settings.__dataclass_fields__) == [opt.dest for opt in OPTIONS]
    for opt in OPTIONS:
        assert isinstance(getattr(settings, opt.dest), (bool, int, float, str, type(None))), opt.dest


def test_at_most_30_options_on_the_command_line_and_the_rest_in_the_ini():
    on_cli = [opt.flag for opt in OPTIONS if opt.cli]
    assert len(on_cli) <= 30, on_cli
    assert all(opt.ini for opt in OPTIONS if not opt.cli)
    assert not [opt.flag for opt in OPTIONS if not opt.cli and opt.action]  # an ini key has a value to parse


@pytest.mark.parametrize(
    ("args", "fixes"),
    [
        (["--target", "cpu", "--layers", "0"], {}),
        (
            ["--target", "cpu", "--max-abs-diff", "0.02"],
            {
                "--max-abs-diff": "--max-abs-diff is an ini key now: set layerparity_max_abs_diff in the project's "
                "pytest ini, or for one run write -o layerparity_max_abs_diff=0.02"
            },
        ),
        (
            ["--max-contribution-bias=320", "--max-noise-ratio", "-n", "2"],
            {
                "--max-contribution-bias": "--max-contribution-bias is an ini key now: set "
                "layerparity_max_contribution_z in the project's pytest ini, or for one run write "
                "-o layerparity_max_contribution_z=320",
                "--max-noise-ratio": "--max-noise-ratio is an ini key now: set layerparity_max_noise_ratio in the "
                "project's pytest ini, or for one run write -o layerparity_max_noise_ratio=X",
            },
        ),
        (
            ["--target", "cpu", "--min-pearson", "-0.5"],
            {
                "--min-pearson": "--min-pearson is an ini key now: set layerparity_min_pearson in the project's pytest "
                "ini, or for one run write -o layerparity_min_pearson=-0.5"
            },
        ),
        (
            ["--trust-remote-code", "--target", "cpu"],
            {
                "--trust-remote-code": "--trust-remote-code is an ini key now: set layerparity_trust_remote_code in "
                "the project's pytest ini, or for one run write -o layerparity_trust_remote_code=true"
            },
        ),
        (
            ["--strict-routing", "--exclude-near-ties"],
            {
                "--strict-routing": "--strict-routing is now --near-ties strict",
                "--exclude-near-ties": "--exclude-near-ties is now --near-ties exclude",
            },
        ),
        (
            ["--nxdi-app", "my port:Cls"],
            {
                "--nxdi-app": "--nxdi-app is an ini key now: set layerparity_nxdi_app in the project's pytest ini, or "
                "for one run write -o 'layerparity_nxdi_app=my port:Cls'"
            },
        ),
    ],
)
def test_a_flag_that_left_the_command_line_says_what_to_write(args, fixes):
    assert moved_flag_fixes(args) == fixes
