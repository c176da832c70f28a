"""Each option and its bad values: usage errors that say what to type instead."""

from __future__ import annotations

import re
import shutil

import pytest


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--xla", "--neuron"],
            "*--xla and --neuron name different targets; choose one: --xla, --neuron or --target NAME*",
        ),
        (["--neuron", "--target", "cpu"], "*--neuron and --target cpu name different targets*"),
        (["--extract"], "*--extract writes goldens from the reference run: use --gpu-golden --extract*"),
        (["--gpu-golden", "--xla"], "*run them as two sessions: pytest --gpu-golden --extract, then pytest --xla*"),
        (
            ["--target", "cpu", "--layers", "9"],
            "*--layers '9': layer 9 is out of range; this model has 6 layers: valid layers are 0-5*",
        ),
        (["--target", "cpu", "--layers", "3-1"], "*range 3-1 is reversed; write 1-3*"),
        (["--target", "cpu", "--layers", "x"], "*cannot read 'x'; use forms like 17, 0-30, 0-5,10,20-25 or all*"),
        (["--target", "cpu", "--layer-ranges", "0-6"], "*--layer-ranges '0-6': layer 6 is out of range*"),
        (
            ["--layer-ranges", "0-1"],
            "*--layer-ranges 0-1 runs ranges of layers end to end on a target (--xla, --neuron or --target NAME); this "
            "run is no layerparity run (no --gpu-golden, --xla, --neuron, --target or --plan): add the one it is for, "
            "or drop --layer-ranges*",
        ),
        (
            ["--gpu-golden", "--bisect"],
            "*--bisect runs chains of layers on a target (--xla, --neuron or --target NAME); this run (--gpu-golden, "
            "without --extract) does not use it: drop --bisect*",
        ),
        (
            ["--target", "cpu", "-o", "layerparity_max_memory=lots"],
            "*-o layerparity_max_memory=lots: 'lots' is not a memory budget (lots); accepted forms: 40GB (every "
            "GPU), 0:60GB,1:60GB,2:40GB (per GPU), cpu:100GB (host)*",
        ),
        (
            ["--target", "cpu", "-o", "layerparity_max_memory=0:60GB,x:1GB"],
            "*'0:60GB,x:1GB' is not a memory budget ('x' is not a GPU index or cpu)*",
        ),
        (["--target", "cpu", "-o", "layerparity_max_memory=0:60"], "*'0:60' is not a memory budget (60)*"),
        (
            ["--gpu-golden", "--device-map", "everywhere"],
            "*'everywhere' is not a device map; choose stream, auto, balanced, balanced_low_0, sequential, cpu or "
            "cuda:N*",
        ),
        (
            ["--target", "cpu", "-o", "layerparity_max_abs_diff=-1"],
            "*-o layerparity_max_abs_diff=-1: '-1' is negative; a tolerance is 0 or more (e.g. 0.01)*",
        ),
        (
            ["--target", "cpu", "-o", "layerparity_max_abs_diff=nan"],
            "*-o layerparity_max_abs_diff=nan: 'nan' is not a finite number*",
        ),
        (
            ["--target", "cpu", "-o", "layerparity_min_cosine=1.5"],
            "*-o layerparity_min_cosine=1.5: '1.5' is not between -1 and 1 (e.g. 0.99)*",
        ),
        (
            ["--target", "cpu", "-o", "layerparity_min_similarity=101"],
            "*'101' is not a percentage between 0 and 100*",
        ),
        (
            ["--target", "cpu", "-o", "layerparity_trust_remote_code=maybe"],
            "*-o layerparity_trust_remote_code=maybe: 'maybe' is not true or false*",
        ),
        (["--target", "cpu", "--near-ties", "loose"], "*argument --near-ties: invalid choice: 'loose'*"),
        (
            ["--target", "cpu", "-o", "layerparity_near_ties=loose"],
            "*-o layerparity_near_ties=loose: 'loose' is not one of leave-out, exclude, strict*",
        ),
        (
            ["--target", "cpu", "--max-abs-diff", "0.02"],
            "*--max-abs-diff is an ini key now: set layerparity_max_abs_diff in the project's pytest ini, or for one "
            "run write -o layerparity_max_abs_diff=0.02*",
        ),
        (
            ["--target", "cpu", "--cores-per-worker=4"],
            "*--cores-per-worker is an ini key now: set layerparity_cores_per_worker in the project's pytest ini, or "
            "for one run write -o layerparity_cores_per_worker=4*",
        ),
        (["--target", "cpu", "--strict-routing"], "*--strict-routing is now --near-ties strict*"),
        (["--target", "cpu", "--exclude-near-ties"], "*--exclude-near-ties is now --near-ties exclude*"),
        (["--target", "cpu", "--seq-len", "0"], "*argument --seq-len: '0' must be a positive integer (1 or more)*"),
        (["--gpu-golden", "--batch-size", "two"], "*'two' is not a whole number; give a positive integer such as 32*"),
        (
            ["--target", "cpu", "--dtype", "int8"],
            "*'int8' is not a supported dtype; choose one of bfloat16, float16, float32*",
        ),
        (
            ["--gpu-golden", "--golden-device", "tpu"],
            "*'tpu' is not a golden device; choose auto, cpu, cuda or cuda:N*",
        ),
        (["--target", "gpu"], "*argument --target: invalid choice: 'gpu'*"),
        (["--port", "neuronx"], "*argument --port: invalid choice: 'neuronx'*"),
        (
            ["--xla", "--port", "nxdi"],
            "*--port nxdi runs NxDI's layers eagerly on the CPU in NxD's CPU mode (--target cpu) or compiled for "
            "NeuronCores (--target neuron), not on --target xla*",
        ),
        (
            ["--target", "cpu", "-o", "layerparity_logical_nc_config=2"],
            "*-o layerparity_logical_nc_config=2 sets the programs NxDI compiles under --port nxdi --target "
            "neuron, and the tensor-parallel groups of --neuron's parallel_state; "
            "this run (--target cpu) does not use it: drop -o layerparity_logical_nc_config=2*",
        ),
        (
            ["--port", "nxdi", "--target", "neuron", "--tp-degree", "4", "-n", "2"],
            "*--port nxdi --target neuron --tp-degree 4 -n 2: each worker's programs run on 4 NeuronCores, and "
            "layerparity_cores_per_worker is 1: add -o layerparity_cores_per_worker=4*",
        ),
        (
            ["--port", "nxdi", "--target", "neuron"],
            "*--neuron: torch_neuronx* not installed; install the AWS Neuron SDK from AWS's repository*",
        ),
        (
            ["--target", "cpu", "-o", "layerparity_nxdi_app=a.b:C"],
            "*-o layerparity_nxdi_app=a.b:C names the NxDI application class of --port nxdi; this run (--target cpu) "
            "does not use it: drop -o layerparity_nxdi_app=a.b:C*",
        ),
        (
            ["--target", "cpu", "-o", "layerparity_layer_module=model.nothing"],
            "*layerparity_layer_module = 'model.nothing' is not a list of layers in MiniMaxM2ForCausalLM; module "
            "lists in this model: model.layers (6)*",
        ),
    ],
)
def test_bad_options_are_usage_errors(project, args, message):
    result = project.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


TP_DEGREE = (
    "ERROR: --tp-degree 2 shards NxDI's port (--port nxdi --target cpu|neuron) or a layer run eagerly on NeuronCores "
    "over torchrun ranks (--neuron --port hf); this run ({run}) does not use it: drop --tp-degree"
)
FOR_A_TARGET = "(--xla, --neuron or --target NAME)"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--xla", "--tp-degree", "2"], TP_DEGREE.format(run="--xla")),
        (["--target", "cpu", "--tp-degree", "2"], TP_DEGREE.format(run="--target cpu")),
        (["--gpu-golden", "--extract", "--tp-degree", "2"], TP_DEGREE.format(run="--gpu-golden --extract")),
        (
            ["--target", "cpu", "--seq-len", "64"],
            "ERROR: --seq-len 64 sets the golden input's length at extraction (--gpu-golden --extract) and in --plan "
            "(a run against stored goldens takes theirs); this run (--target cpu) does not use it: drop --seq-len",
        ),
        (
            ["--xla", "--prompt", "hello world"],
            "ERROR: --prompt 'hello world' is the golden input at extraction (--gpu-golden --extract; a run against "
            "stored goldens takes theirs); this run (--xla) does not use it: drop --prompt",
        ),
        (
            ["--gpu-golden", "--decode-steps", "0"],
            "ERROR: --decode-steps 0 sets the decode steps recorded at extraction (--gpu-golden --extract) and in "
            "--plan (a run against stored goldens takes theirs); this run (--gpu-golden, without --extract) does not "
            "use it: drop --decode-steps",
        ),
        (
            ["--target", "cpu", "--golden-device", "cpu"],
            "ERROR: --golden-device cpu is the device of the reference model (--gpu-golden, --plan); this run "
            "(--target cpu) does not use it: drop --golden-device",
        ),
        (
            ["--target", "cpu", "--no-precision-floor"],
            "ERROR: --no-precision-floor skips the precision floor at extraction (--gpu-golden --extract; --plan); "
            "this run (--target cpu) does not use it: drop --no-precision-floor",
        ),
        (
            ["--target", "cpu", "--compile-cache", "cc"],
            "ERROR: --compile-cache cc keeps the graphs that --xla and --neuron compile; this run (--target cpu) does "
            "not use it: drop --compile-cache",
        ),
        (
            ["--xla", "-o", "layerparity_max_memory=40GB"],
            "ERROR: -o layerparity_max_memory=40GB sets the memory budget of --gpu-golden's reference model placed "
            "whole by accelerate (not --device-map stream); this run (--xla) does not use it: drop -o "
            "layerparity_max_memory=40GB",
        ),
        (
            ["--gpu-golden", "--extract", "--near-ties", "strict"],
            "ERROR: --near-ties strict sets the verdict of the runs that judge outputs against stored goldens (--xla, "
            "--neuron or --target NAME; --gpu-golden); this run (--gpu-golden --extract) does not use it: drop "
            "--near-ties",
        ),
        (
            ["--gpu-golden", "--extract", "--save-outputs", "out"],
            f"ERROR: --save-outputs out keeps the target's outputs of a parity run {FOR_A_TARGET}; this run "
            "(--gpu-golden --extract) does not use it: drop --save-outputs",
        ),
        (
            ["--target", "cpu", "-o", "layerparity_op_atol=0.1"],
            "ERROR: -o layerparity_op_atol=0.1 is the tolerance of --op-compare's ops in a parity run of the model's "
            "own layers (--port hf), re-run op by op; this run (--target cpu) does not use it: drop -o "
            "layerparity_op_atol=0.1",
        ),
        (
            ["--plan", "--layers", "3"],
            f"ERROR: --layers 3 selects the layers of a --gpu-golden or parity run {FOR_A_TARGET}; this run (--plan) "
            "does not use it: drop --layers",
        ),
        (
            ["--tp-degree", "2"],
            "ERROR: --tp-degree 2 shards NxDI's port (--port nxdi --target cpu|neuron) or a layer run eagerly on "
            "NeuronCores over torchrun ranks (--neuron --port hf); this run is no layerparity run (no --gpu-golden, "
            "--xla, --neuron, --target or --plan): add the one it is for, or drop --tp-degree",
        ),
    ],
)
def test_an_option_this_run_does_not_use_is_refused(project, args, message):
    result = project.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_every_option_this_run_does_not_use_is_named_at_once(project):
    result = project.runpytest("--xla", "--tp-degree", "2", "--batch-size", "2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    second = TP_DEGREE.format(run="--xla").removeprefix("ERROR: ")  # (pytest prefixes the first line only)
    result.stderr.fnmatch_lines(["ERROR: --batch-size 2 sets the golden input's sequences *", second])


def test_an_ini_key_this_run_does_not_use_is_named_in_the_header(project):
    """A project's ini sets layerparity_tp_degree for its Neuron runs: its --target cpu runs
    are not refused for it; their header says it is not used."""
    ini = project.path / "tox.ini"
    ini.write_text(ini.read_text() + "\nlayerparity_tp_degree = 8\n")
    result = project.runpytest("--target", "cpu", "--layers", "0")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "layerparity: ini layerparity_tp_degree = 8 not used by this run (--target cpu): it shards NxDI's port "
            "(--port nxdi --target cpu|neuron) or a layer run eagerly on NeuronCores over torchrun ranks (--neuron "
            "--port hf)",
        ]
    )


def test_model_folder_without_config_json(project):
    project.mkdir("empty")
    result = project.runpytest("--target", "cpu", "--model", "empty")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*empty has no config.json; --model must be a HuggingFace model folder (config.json and safetensors weights)*"]
    )


def test_no_model_configured(pytester):
    result = pytester.runpytest("--target", "cpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*no model given: pass --model DIR (a HuggingFace model folder) or set layerparity_model in your pytest ini*"]
    )


def test_path_option_that_hides_the_ini_is_a_usage_error(project, tmp_path_factory):
    # pytest picks its ini before plugins' options are known: the value of "--golden-dir DIR",
    # outside the project, is taken for a test path and the project's ini goes unread.
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "goldens"
    shutil.copytree(project.path / "goldens", elsewhere)
    result = project.runpytest("--target", "cpu", "--layers", "0", "--golden-dir", str(elsewhere))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            f"*pytest read no ini file: it took {elsewhere} (the value of --golden-dir) for a test path*"
            f"write --golden-dir={elsewhere}, or add -c {project.path / 'tox.ini'}"
        ]
    )
    project.runpytest("--target", "cpu", "--layers", "0", f"--golden-dir={elsewhere}").assert_outcomes(passed=1)


def test_bad_ini_value_is_a_usage_error(project):
    project.makeini(
        """
        [pytest]
        layerparity_max_abs_diff = -0.5
        """
    )
    result = project.runpytest("--target", "cpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ini option layerparity_max_abs_diff = '-0.5': '-0.5' is negative*"])


def test_neuron_sdk_missing_names_the_install(project):
    result = project.runpytest("--neuron")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*--neuron: torch_neuronx, neuronx_distributed not installed; install the AWS Neuron SDK from AWS's "
            "repository, not from PyPI*",
        ]
    )


def test_no_mode_adds_no_tests(project):
    project.makepyfile("def test_own(): pass")
    result = project.runpytest()
    result.assert_outcomes(passed=1)


def test_help_lists_every_option(pytester):
    from pytest_layerparity.options import OPTIONS

    result = pytester.runpytest("--help")
    text = result.stdout.str()
    for option in OPTIONS:
        on_cli = re.search(rf"^  {option.flag}\b", text, flags=re.MULTILINE) is not None
        assert on_cli == option.cli, option.flag
        if option.ini:
            assert f"  {option.ini_name} (string):" in text, option.ini_name


def test_ini_keys_take_a_value_for_one_run_with_dash_o(pytester):
    from pytest_layerparity.options import read_settings

    pytester.makeini("[pytest]\nlayerparity_near_ties = exclude\nlayerparity_max_abs_diff = 0.2\n")
    settings = read_settings(pytester.parseconfig())
    assert (settings.near_ties, settings.max_abs_diff, settings.trust_remote_code) == ("exclude", 0.2, False)
    settings = read_settings(
        pytester.parseconfig(
            "--near-ties", "strict", "-o", "layerparity_max_abs_diff=0.5", "-o", "layerparity_trust_remote_code=true"
        )
    )
    assert (settings.near_ties, settings.max_abs_diff, settings.trust_remote_code) == ("strict", 0.5, True)


def test_a_one_run_path_is_relative_to_where_pytest_started(pytester):
    from pytest_layerparity.options import read_settings, resolve_paths

    pytester.makeini("[pytest]\nlayerparity_offload_folder = offload\n")
    sub = pytester.mkdir("sub")
    config = pytester.parseconfig()
    assert resolve_paths(read_settings(config), config).offload_folder == str(pytester.path / "offload")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(sub)
        config = pytester.parseconfig("-o", "layerparity_offload_folder=offload", "-c", str(pytester.path / "tox.ini"))
        assert resolve_paths(read_settings(config), config).offload_folder == str(sub / "offload")


def test_a_flag_of_a_conftest_by_a_name_that_left_is_the_conftests(pytester):
    pytester.makeconftest("def pytest_addoption(parser):\n    parser.addoption('--seed', type=int)\n")
    pytester.makepyfile("def test_seed(request):\n    assert request.config.getoption('seed') == 7\n")
    pytester.runpytest("--seed", "7", "-p", "no:cacheprovider").assert_outcomes(passed=1)


OWN_LAYER = """
import pytest

@pytest.hookimpl
def pytest_layerparity_build_target_layer(layer_idx, reference_layer, model_config, device):
    return None
"""


@pytest.mark.parametrize(
    ("args", "own_layer", "port", "compiled"),
    [
        (["--neuron"], False, "nxdi", True),  # --neuron is --port nxdi --target neuron
        (["--target", "neuron"], False, "nxdi", True),
        (["--neuron"], True, "hf", False),  # a conftest's own port runs eagerly on the NeuronCore
        (["--neuron", "--port", "hf"], False, "hf", False),
        (["--neuron", "--port", "nxdi"], True, "nxdi", True),  # the option wins over the hook
        (["--xla"], False, "hf", False),
        (["--target", "cpu"], False, "hf", False),
        (["--port", "nxdi", "--target", "cpu"], False, "nxdi", False),
    ],
)
def test_which_port_is_under_test(pytester, args, own_layer, port, compiled):
    from pytest_layerparity.options import read_settings

    if own_layer:
        pytester.makeconftest(OWN_LAYER)
    settings = read_settings(pytester.parseconfig(*args))
    assert (settings.port, settings.compiled) == (port, compiled)
