"""Which runs use each option: one entry per option of :data:`~.options.OPTIONS`, and the
refusal of an option this run was given but does not use.

A run is ``--plan``, an extraction (``--gpu-golden --extract``), a verification
(``--gpu-golden``), a parity run on a target and port (``--xla``, ``--neuron``, ``--target
NAME``, ``--port``), or no layerparity run at all. An option given for this run (its flag, or
``-o layerparity_<name>=VALUE``) that the run does not use is a usage error naming what would
use it; one set in the ini file is a standing setting of the project (its Neuron runs' tensor
parallelism, its extractions' length), which the session header mentions instead.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from .options import (
    OPTIONS,
    Option,
    RunMode,
    Settings,
    check_ini_not_lost,
    overridden_ini_keys,
    read_settings,
    resolve_paths,
)


@dataclass(frozen=True)
class Use:
    """Whether a run uses an option (``used``), and what the option does for the runs that
    do (``does``: a phrase after the option, naming those runs)."""

    used: Callable[[Settings], bool]
    does: str


def _always(s: Settings) -> bool:
    return True


def _active(s: Settings) -> bool:
    """Any layerparity run, --plan included."""
    return s.plan or s.mode is not None


def _session(s: Settings) -> bool:
    """A run of tests: extraction, verification or parity (not --plan)."""
    return not s.plan and s.mode is not None


def _extraction(s: Settings) -> bool:
    return not s.plan and s.mode == RunMode.EXTRACT


def _reference(s: Settings) -> bool:
    """The reference model runs: extraction or verification."""
    return not s.plan and s.mode in (RunMode.EXTRACT, RunMode.VERIFY)


def _judged(s: Settings) -> bool:
    """Outputs are judged against stored goldens: verification or parity."""
    return not s.plan and s.mode in (RunMode.VERIFY, RunMode.PARITY)


def _parity(s: Settings) -> bool:
    return not s.plan and s.mode == RunMode.PARITY


def _sized(s: Settings) -> bool:
    """The golden input's shape is this run's: an extraction, or --plan's estimate of one."""
    return s.plan or _extraction(s)


def _plan_reads_store(s: Settings) -> bool:
    """--plan takes the stored goldens' dtype where --dtype is not given (unless extracting)."""
    return s.plan and s.dtype is None and s.mode != RunMode.EXTRACT


def _chains(s: Settings) -> bool:
    return _parity(s) and bool(s.chain or s.bisect or s.layer_ranges)


def _op_by_op(s: Settings) -> bool:
    """--op-compare re-runs the model's own layers op by op (an NxDI port's are compared by
    sub-block, a compiled program's not at all)."""
    return _parity(s) and s.op_compare and s.port != "nxdi"


TARGETS = "--xla, --neuron or --target NAME"
VERDICT = f"sets the verdict of the runs that judge outputs against stored goldens ({TARGETS}; --gpu-golden)"
SHAPE = "at extraction (--gpu-golden --extract) and in --plan (a run against stored goldens takes theirs)"
PLACEMENT = "of --gpu-golden's reference model placed whole by accelerate (not --device-map stream)"
OP_BY_OP = "in a parity run of the model's own layers (--port hf), re-run op by op"

#: Option (its ``dest``) -> which runs use it. Every entry of OPTIONS has one (a unit test
#: checks it): a new option is decided here.
USES: dict[str, Use] = {
    # the options that choose the run: check_combinations refuses their contradictions
    "gpu_golden": Use(_always, "runs the reference model"),
    "extract": Use(_always, "writes goldens"),
    "xla": Use(_always, "chooses the torch-xla target"),
    "neuron": Use(_always, "chooses the Neuron target"),
    "target": Use(_always, "chooses the target"),
    "plan": Use(_always, "prints the memory plan"),
    # what each run reads
    "golden_device": Use(
        lambda s: s.plan or _reference(s), "is the device of the reference model (--gpu-golden, --plan)"
    ),
    "port": Use(_parity, f"chooses whose layers a parity run tests ({TARGETS})"),
    "nxdi_app": Use(lambda s: _parity(s) and s.port == "nxdi", "names the NxDI application class of --port nxdi"),
    "model": Use(_active, f"is the model of a layerparity run (--gpu-golden, {TARGETS} or --plan)"),
    "golden_dir": Use(
        lambda s: _session(s) or _plan_reads_store(s),
        f"is the golden store that --gpu-golden --extract writes and --gpu-golden and {TARGETS} read (and --plan, "
        "for the goldens' dtype where --dtype is not given)",
    ),
    "layers": Use(_session, f"selects the layers of a --gpu-golden or parity run ({TARGETS})"),
    "layer_ranges": Use(_parity, f"runs ranges of layers end to end on a target ({TARGETS})"),
    "layer_module": Use(_active, f"names the layer list for a layerparity run (--gpu-golden, {TARGETS} or --plan)"),
    "seq_len": Use(_sized, f"sets the golden input's length {SHAPE}"),
    "decode_steps": Use(_sized, f"sets the decode steps recorded {SHAPE}"),
    "logits_topk": Use(_extraction, "sets the whole model's golden written by --gpu-golden --extract"),
    "batch_size": Use(_sized, f"sets the golden input's sequences {SHAPE}"),
    "seed": Use(_extraction, "seeds the golden input's token ids at extraction (--gpu-golden --extract)"),
    "prompt": Use(
        _extraction,
        "is the golden input at extraction (--gpu-golden --extract; a run against stored goldens takes theirs)",
    ),
    "dtype": Use(_active, f"sets the dtype of a layerparity run (--gpu-golden, {TARGETS} or --plan)"),
    "max_abs_diff": Use(_judged, VERDICT),
    "max_mean_abs_diff": Use(_judged, VERDICT),
    "min_similarity": Use(_judged, VERDICT),
    "min_cosine": Use(_judged, VERDICT),
    "min_pearson": Use(_judged, VERDICT),
    "verdict": Use(_judged, VERDICT),
    "max_noise_ratio": Use(_judged, VERDICT),
    "max_token_noise_ratio": Use(_judged, VERDICT),
    "max_contribution_z": Use(_judged, VERDICT),
    "false_alarm_rate": Use(_judged, VERDICT),
    "envelope_samples": Use(
        lambda s: _sized(s) or _chains(s),
        "sets the perturbed runs of the noise envelope made at extraction (--gpu-golden --extract, and in --plan) and "
        "for the chained runs of --chain, --bisect and --layer-ranges",
    ),
    "near_ties": Use(_judged, VERDICT),
    "router_tie_tolerance": Use(_judged, VERDICT),
    "no_precision_floor": Use(_sized, "skips the precision floor at extraction (--gpu-golden --extract; --plan)"),
    "force_regen": Use(_extraction, "replaces a golden store by a new extraction (--gpu-golden --extract)"),
    "device_map": Use(_reference, "places the reference model of --gpu-golden (--plan shows every placement)"),
    "max_memory": Use(lambda s: _reference(s) and s.device_map != "stream", f"sets the memory budget {PLACEMENT}"),
    "offload_folder": Use(
        lambda s: _reference(s) and s.device_map != "stream", f"is the folder of the weights offloaded {PLACEMENT}"
    ),
    "parity_report": Use(_session, f"writes the report of a --gpu-golden or parity run ({TARGETS})"),
    "save_outputs": Use(_parity, f"keeps the target's outputs of a parity run ({TARGETS})"),
    "chain": Use(_parity, f"runs chains of layers on a target ({TARGETS})"),
    "bisect": Use(_parity, f"runs chains of layers on a target ({TARGETS})"),
    "op_compare": Use(_parity, f"re-runs a failing layer of a parity run op by op ({TARGETS})"),
    "op_compare_dir": Use(_op_by_op, f"is where --op-compare writes the failing op {OP_BY_OP}"),
    "op_atol": Use(_op_by_op, f"is the tolerance of --op-compare's ops {OP_BY_OP}"),
    "op_rtol": Use(_op_by_op, f"is the tolerance of --op-compare's ops {OP_BY_OP}"),
    "tp_degree": Use(
        lambda s: _parity(s) and (s.port == "nxdi" or s.target_name == "neuron"),
        "shards NxDI's port (--port nxdi --target cpu|neuron) or a layer run eagerly on NeuronCores over torchrun "
        "ranks (--neuron --port hf)",
    ),
    "ep_degree": Use(
        lambda s: _parity(s) and s.compiled,
        "shards the experts of NxDI's MoE programs compiled under --port nxdi --target neuron (NxD's CPU mode has no "
        "expert parallelism: neuronx-distributed makes its MoE expert-parallel process groups the XLA way only, "
        "'ProcessGroup' object has no attribute '_mesh', and NxDI would run plain tensor parallelism instead; there "
        "--tp-degree alone shards the experts)",
    ),
    "logical_nc_config": Use(
        lambda s: _parity(s) and s.target_name == "neuron",
        "sets the programs NxDI compiles under --port nxdi --target neuron, and the tensor-parallel groups of "
        "--neuron's parallel_state",
    ),
    "experts_implementation": Use(_parity, f"sets the MoE experts of the layers built on a target ({TARGETS})"),
    "attn_implementation": Use(
        lambda s: s.plan or _reference(s), "sets the attention of the reference model (--gpu-golden, --plan)"
    ),
    "trust_remote_code": Use(
        _active, f"lets a layerparity run import the model's own code (--gpu-golden, {TARGETS} or --plan)"
    ),
    "cores_per_worker": Use(
        lambda s: _parity(s) and s.target_name == "neuron", "sets the NeuronCores of each xdist worker of --neuron"
    ),
    "compile_cache": Use(
        lambda s: _parity(s) and s.target_name in ("xla", "neuron"), "keeps the graphs that --xla and --neuron compile"
    ),
}


def run_words(s: Settings) -> str:
    """This run, as the command line chose it (``--xla``, ``--port nxdi --target cpu``...)."""
    if s.plan:
        return "--plan"
    if s.mode == RunMode.EXTRACT:
        return "--gpu-golden --extract"
    if s.mode == RunMode.VERIFY:
        return "--gpu-golden, without --extract"
    if s.mode is None:
        return "no layerparity run (no --gpu-golden, --xla, --neuron, --target or --plan)"
    words = "--xla" if s.xla else "--neuron" if s.neuron else f"--target {s.target}"
    if s.port == "nxdi" and not s.neuron:
        words += " --port nxdi"
    elif s.port == "hf" and s.target_name == "neuron":
        words += " --port hf"
    return words


def given_options(config: pytest.Config) -> dict[str, str]:
    """The options this run's command line gave (``dest`` -> the words: ``--tp-degree 2``,
    ``-o layerparity_tp_degree=2``): a flag present, or an ini key set with ``-o``. Present,
    not "other than the default": ``--tp-degree 1`` or ``--decode-steps 2`` typed for a run
    that has no use for them is a request the run cannot honour all the same."""
    overrides = {}
    for item in getattr(config.option, "override_ini", None) or ():
        key, _, value = item.partition("=")
        overrides[key.strip()] = value
    given = {}
    for opt in OPTIONS:
        value = config.getoption(opt.option_name) if opt.cli else None
        if opt.action == "store_true":
            if value:
                given[opt.dest] = opt.flag
        elif value is not None:
            given[opt.dest] = f"{opt.flag} {shlex.quote(str(value))}"
        elif opt.ini and opt.ini_name in overrides:
            given[opt.dest] = f"-o {shlex.quote(f'{opt.ini_name}={overrides[opt.ini_name]}')}"
    return given


def given_by_value(settings: Settings) -> dict[str, str]:
    """The options whose value is not the default (for settings made without pytest:
    :func:`~.options.make_settings`), as the command line would give them."""
    from .options import default_port

    given = {}
    for opt in OPTIONS:
        value = getattr(settings, opt.dest)
        default = opt.default
        if opt.dest == "port":
            default = default_port(settings.target, settings.xla, settings.neuron, own_port=False)
        if value != default:
            given[opt.dest] = _words(opt, value)
    return given


def _words(opt: Option, value: Any) -> str:
    if opt.action == "store_true":
        return opt.flag
    if opt.cli:
        return f"{opt.flag} {shlex.quote(str(value))}"
    return f"-o {shlex.quote(f'{opt.ini_name}={value}')}"


def refusal(settings: Settings, dest: str, words: str) -> str:
    """The usage error of option ``dest``, given as ``words``, in a run that does not use it."""
    use = USES[dest]
    drop = words if words.startswith("-o ") else words.split(" ", 1)[0]
    if settings.mode is None and not settings.plan:
        return f"{words} {use.does}; this run is {run_words(settings)}: add the one it is for, or drop {drop}"
    return f"{words} {use.does}; this run ({run_words(settings)}) does not use it: drop {drop}"


def check_used(settings: Settings, given: Mapping[str, str]) -> None:
    """Raise UsageError for each option in ``given`` (``dest`` -> its words) that this run
    does not use, naming what would use it."""
    refused = [refusal(settings, dest, words) for dest, words in given.items() if not USES[dest].used(settings)]
    if refused:
        raise pytest.UsageError("\n".join(refused))


def unused_ini_lines(settings: Settings, config: pytest.Config) -> list[str]:
    """Header lines for the ini keys set in the ini file (not for this run) that this run
    does not use: a standing setting of the project, mentioned, not refused."""
    given = given_options(config)
    overridden = overridden_ini_keys(config)
    lines = []
    for opt in OPTIONS:
        if not opt.ini or opt.dest in given or opt.ini_name in overridden or USES[opt.dest].used(settings):
            continue
        raw = config.getini(opt.ini_name)
        if raw in (None, "", []):
            continue
        lines.append(
            f"layerparity: ini {opt.ini_name} = {raw} not used by this run ({run_words(settings)}): it "
            f"{USES[opt.dest].does}"
        )
    return lines


def current_settings(config: pytest.Config) -> Settings:
    """The session's settings: every option read (command line over ini over default), paths
    made absolute, contradictions and options this run does not use refused."""
    check_ini_not_lost(config)
    settings = resolve_paths(read_settings(config), config)
    check_combinations(settings, given_options(config))
    return settings


def check_combinations(settings: Settings, given: Mapping[str, str] | None = None) -> None:
    """Raise UsageError for options that contradict each other, and for options ``given`` for
    this run (``dest`` -> how they were written: ``--tp-degree 2``) that it does not use,
    saying what to type instead. ``given`` None: every option whose value is not its default
    (settings made without pytest)."""
    chosen = [
        flag
        for flag, on in (
            ("--xla", settings.xla),
            ("--neuron", settings.neuron),
            (f"--target {settings.target}", settings.target),
        )
        if on
    ]
    if len(chosen) > 1:
        raise pytest.UsageError(
            f"{' and '.join(chosen)} name different targets; choose one: --xla, --neuron or --target NAME"
        )
    if settings.port == "nxdi" and settings.target_name not in (None, "cpu", "neuron"):
        raise pytest.UsageError(
            f"--port nxdi runs NxDI's layers eagerly on the CPU in NxD's CPU mode (--target cpu) or compiled for "
            f"NeuronCores (--target neuron), not on --target {settings.target_name}"
        )
    if settings.envelope_samples == 1:
        raise pytest.UsageError(
            "--envelope-samples 1 cannot show a spread: give 2 or more perturbed runs (e.g. 12), or 0 for none"
        )
    if settings.extract and not settings.gpu_golden:
        raise pytest.UsageError("--extract writes goldens from the reference run: use --gpu-golden --extract")
    if settings.gpu_golden and settings.target_name:
        raise pytest.UsageError(
            f"--gpu-golden runs the reference and --{settings.target_name} the port; run them as two sessions: "
            f"pytest --gpu-golden --extract, then pytest --{settings.target_name}"
        )
    check_used(settings, given_by_value(settings) if given is None else given)
    if settings.compiled and settings.ep_degree > 1:
        check_ep_degree(settings)


def check_ep_degree(settings: Settings) -> None:
    """Expert parallelism of NxDI's compiled programs divides their tensor-parallel ranks."""
    ep, tp = settings.ep_degree, settings.tp_degree
    if tp % ep:
        raise pytest.UsageError(
            f"layerparity_ep_degree = {ep} must divide --tp-degree {tp}: NxDI shards the experts over moe_ep_degree x "
            "moe_tp_degree = tp_degree ranks"
        )
