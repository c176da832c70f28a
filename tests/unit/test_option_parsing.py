"""Table tests of the option parsers and settings (pytest_layerparity.options)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pytest_layerparity.option_uses import USES, check_combinations, given_options, unused_ini_lines
from pytest_layerparity.options import (
    OPTIONS,
    Settings,
    boolean,
    correlation,
    device_map_choice,
    dtype_choice,
    golden_device,
    make_settings,
    max_memory_spec,
    moved_flag_fixes,
    non_negative_int,
    parse_max_memory,
    percentage,
    positive_int,
    read_settings,
    resolve_cache_location,
    size_bytes,
    tolerance,
)
from pytest_layerparity.reference.inputs import stored_input_shape


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
        (dtype_choice, "bf16", "bfloat16"),
        (dtype_choice, " FP16 ", "float16"),
        (dtype_choice, "half", "float16"),
        (dtype_choice, "float", "float32"),
        (dtype_choice, "float32", "float32"),
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
        (dtype_choice, "int8", "'int8' is not a supported dtype; choose one of bfloat16, float16, float32"),
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
        (
            {"chain": True},
            "--chain runs chains of layers on a target (--xla, --neuron or --target NAME); this run is no layerparity "
            "run (no --gpu-golden, --xla, --neuron, --target or --plan): add the one it is for, or drop --chain",
        ),
        (
            {"bisect": True, "gpu_golden": True},
            "--bisect runs chains of layers on a target (--xla, --neuron or --target NAME); this run (--gpu-golden, "
            "without --extract) does not use it: drop --bisect",
        ),
        (
            {"layer_ranges": "0-1", "gpu_golden": True, "extract": True},
            "--layer-ranges 0-1 runs ranges of layers end to end on a target (--xla, --neuron or --target NAME); this "
            "run (--gpu-golden --extract) does not use it: drop --layer-ranges",
        ),
        (
            {"xla": True, "tp_degree": 2},
            "--tp-degree 2 shards NxDI's port (--port nxdi --target cpu|neuron) or a layer run eagerly on NeuronCores "
            "over torchrun ranks (--neuron --port hf); this run (--xla) does not use it: drop --tp-degree",
        ),
        (
            {"port": "nxdi", "target": "cpu", "ep_degree": 2},
            "-o layerparity_ep_degree=2 shards the experts of NxDI's MoE programs compiled under --port nxdi --target "
            "neuron (NxD's CPU mode has no expert parallelism: neuronx-distributed makes its MoE expert-parallel "
            "process groups the XLA way only, 'ProcessGroup' object has no attribute '_mesh', and NxDI would run plain "
            "tensor parallelism instead; there --tp-degree alone shards the experts); this run (--target cpu --port "
            "nxdi) does not use it: drop -o layerparity_ep_degree=2",
        ),
        (
            {"neuron": True, "tp_degree": 4, "ep_degree": 3},
            "layerparity_ep_degree = 3 must divide --tp-degree 4: NxDI shards the experts over moe_ep_degree x "
            "moe_tp_degree = tp_degree ranks",
        ),
    ],
)
def test_contradictions_are_usage_errors(values, message):
    with pytest.raises(pytest.UsageError) as info:
        check_combinations(make_settings(**values))
    assert str(info.value) == message


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"xla": True, "chain": True, "bisect": True},
        {"gpu_golden": True},
        {"neuron": True, "tp_degree": 4, "ep_degree": 2, "logical_nc_config": 2},
        {"port": "nxdi", "target": "cpu", "tp_degree": 2},
        {"neuron": True, "port": "hf", "tp_degree": 2},
    ],
)
def test_consistent_settings_pass(values):
    check_combinations(make_settings(**values))


def test_every_option_is_decided_for_every_run():
    """A new option in OPTIONS needs its entry in USES: which runs use it, and what it does."""
    assert set(USES) == {opt.dest for opt in OPTIONS}
    for dest, use in USES.items():
        assert use.does and not use.does[0].isupper() and not use.does.endswith("."), dest


XLA, CPU, NXDI_CPU = {"xla": True}, {"target": "cpu"}, {"port": "nxdi", "target": "cpu"}
NEURON_HF, COMPILED = {"neuron": True, "port": "hf"}, {"neuron": True}
EXTRACT, VERIFY, PLAN = {"gpu_golden": True, "extract": True}, {"gpu_golden": True}, {"plan": True}


@pytest.mark.parametrize(
    ("dest", "run", "used"),
    [
        ("tp_degree", XLA, False),
        ("tp_degree", CPU, False),
        ("tp_degree", {"target": "cuda"}, False),
        ("tp_degree", EXTRACT, False),
        ("tp_degree", NXDI_CPU, True),
        ("tp_degree", NEURON_HF, True),
        ("tp_degree", COMPILED, True),
        ("ep_degree", NXDI_CPU, False),
        ("ep_degree", COMPILED, True),
        ("compile_cache", CPU, False),
        ("compile_cache", NXDI_CPU, False),
        ("compile_cache", XLA, True),
        ("compile_cache", COMPILED, True),
        ("seq_len", XLA, False),
        ("seq_len", VERIFY, False),  # a verification re-runs the stored input
        ("seq_len", EXTRACT, True),
        ("seq_len", PLAN, True),
        ("decode_steps", VERIFY, False),
        ("prompt", PLAN, False),
        ("envelope_samples", XLA, False),
        ("envelope_samples", {**XLA, "chain": True}, True),
        ("envelope_samples", VERIFY, False),
        ("envelope_samples", PLAN, True),
        ("max_abs_diff", EXTRACT, False),
        ("max_abs_diff", VERIFY, True),
        ("near_ties", CPU, True),
        ("golden_device", CPU, False),
        ("golden_device", PLAN, True),
        ("device_map", PLAN, False),
        ("max_memory", VERIFY, True),
        ("max_memory", {**VERIFY, "device_map": "stream"}, False),
        ("attn_implementation", XLA, False),
        ("attn_implementation", EXTRACT, True),
        ("experts_implementation", EXTRACT, False),
        ("op_atol", {**XLA, "op_compare": True}, True),
        ("op_atol", XLA, False),
        ("op_atol", {**NXDI_CPU, "op_compare": True}, False),  # an NxDI port is compared by sub-block
        ("port", EXTRACT, False),
        ("golden_dir", PLAN, True),  # the goldens' dtype
        ("golden_dir", {**PLAN, "dtype": "float32"}, False),
        ("layers", PLAN, False),
        ("parity_report", EXTRACT, True),
        ("model", {}, False),
        ("cores_per_worker", XLA, False),
        ("cores_per_worker", NEURON_HF, True),
    ],
)
def test_which_runs_use_an_option(dest, run, used):
    assert USES[dest].used(make_settings(**run)) is used


def test_an_option_given_for_a_run_that_does_not_use_it_names_what_would(pytester):
    config = pytester.parseconfig("--xla", "--tp-degree", "2", "-o", "layerparity_seq_len=64", "--near-ties", "strict")
    given = given_options(config)
    assert given == {
        "xla": "--xla",
        "tp_degree": "--tp-degree 2",
        "seq_len": "-o layerparity_seq_len=64",
        "near_ties": "--near-ties strict",
    }
    with pytest.raises(pytest.UsageError) as info:
        check_combinations(make_settings(xla=True, tp_degree=2, seq_len=64, near_ties="strict"), given)
    assert str(info.value).splitlines() == [
        "-o layerparity_seq_len=64 sets the golden input's length at extraction (--gpu-golden --extract) and in "
        "--plan (a run against stored goldens takes theirs); this run (--xla) does not use it: drop -o "
        "layerparity_seq_len=64",
        "--tp-degree 2 shards NxDI's port (--port nxdi --target cpu|neuron) or a layer run eagerly on NeuronCores over "
        "torchrun ranks (--neuron --port hf); this run (--xla) does not use it: drop --tp-degree",
    ]


def test_an_ini_value_is_a_standing_setting_named_not_refused(pytester):
    pytester.makeini("[pytest]\nlayerparity_tp_degree = 8\nlayerparity_near_ties = strict\n")
    config = pytester.parseconfig("--xla")
    settings = read_settings(config)
    assert given_options(config) == {"xla": "--xla"}
    check_combinations(settings, given_options(config))
    assert unused_ini_lines(settings, config) == [
        "layerparity: ini layerparity_tp_degree = 8 not used by this run (--xla): it shards NxDI's port (--port nxdi "
        "--target cpu|neuron) or a layer run eagerly on NeuronCores over torchrun ranks (--neuron --port hf)"
    ]
    config = pytester.parseconfig("--xla", "-o", "layerparity_tp_degree=4")  # for this run: refused
    assert given_options(config)["tp_degree"] == "-o layerparity_tp_degree=4"
    assert unused_ini_lines(read_settings(config), config) == []


@pytest.mark.parametrize(
    ("manifest", "shape"),
    [
        (None, (1, 32)),
        ({"inputs": {"batch_size": 2, "seq_len": 8}}, (2, 8)),
        ({"inputs": {"source": "prompt", "batch_size": 1, "seq_len": None}}, (1, 32)),
    ],
)
def test_a_verification_is_placed_for_the_stored_input(manifest, shape):
    settings = stored_input_shape(make_settings(gpu_golden=True), manifest)
    assert (settings.batch_size, settings.seq_len) == shape


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
