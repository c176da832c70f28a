"""Command-line options and ini keys: the one table of options, the settings they make, and
the small pure functions that parse each value and raise with the fix.

The command line holds what a run chooses (mode, target, model, layers, input, verdict);
limits and pass-throughs that a project sets once are ini keys only (``layerparity_<name>``,
for one run ``-o layerparity_<name>=VALUE``). Everything that reads an option reads it here
(:func:`read_settings`), the plugin and the distributed runs alike; which runs use each
option, and the refusal of one a run does not use, is :mod:`.option_uses`.

Long because it is the table of every option and ini key (its help text, parser and
default, one entry each) and their parsers: one job, read entry by entry.
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, make_dataclass, replace
from pathlib import Path
from typing import Any, get_type_hints

import pytest

DTYPES = ("bfloat16", "float16", "float32")
NEAR_TIES = ("leave-out", "exclude", "strict")
GOLDEN_DEVICES_HELP = "auto, cpu, cuda or cuda:N"
DEVICE_MAP_CHOICES = ("stream", "auto", "balanced", "balanced_low_0", "sequential", "cpu")
MAX_MEMORY_FORMS = (
    "40GB (every GPU), 0:60GB,1:60GB,2:40GB (per GPU), cpu:100GB (host), units B/KB/MB/GB/TB or KiB/MiB/GiB/TiB"
)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "B": 1,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number; give a positive integer such as 32"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer (1 or more)")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give 0 or more") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if math.isnan(value) or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def tolerance(text: str) -> float:
    """A difference bound: finite and >= 0."""
    value = _finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative; a tolerance is 0 or more (e.g. 0.01)")
    return value


def probability(text: str) -> float:
    """A false-alarm rate: strictly between 0 and 0.5."""
    value = _finite_float(text)
    if not 0 < value < 0.5:
        raise argparse.ArgumentTypeError(f"{text!r} is not a probability between 0 and 0.5 (e.g. 0.001)")
    return value


def percentage(text: str) -> float:
    value = _finite_float(text)
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage between 0 and 100 (e.g. 95)")
    return value


def correlation(text: str) -> float:
    value = _finite_float(text)
    if not -1 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not between -1 and 1 (e.g. 0.99)")
    return value


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "yes", "on", "1"):
        return True
    if value in ("false", "no", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


def dtype_name(text: str) -> str:
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    value = aliases.get(text.strip().lower(), text.strip().lower())
    if value not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a supported dtype; choose one of {', '.join(DTYPES)}")
    return value


def golden_device(text: str) -> str:
    value = text.strip().lower()
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"{text!r} is not a golden device; choose {GOLDEN_DEVICES_HELP}")


def size_bytes(text: str) -> int:
    """``40GB`` -> 40_000_000_000; ValueError for anything else."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(text)
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def max_memory_spec(text: str) -> str:
    """Parser of layerparity_max_memory: checks the form, keeps the text."""
    try:
        parse_max_memory(text, gpus=1)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a memory budget ({exc}); accepted forms: {MAX_MEMORY_FORMS}"
        ) from None
    return text


def parse_max_memory(text: str, gpus: int | None = None) -> dict[int | str, str]:
    """'40GB' -> every visible GPU gets 40GB; '0:60GB,1:40GB,cpu:100GB' -> per device
    (accelerate's ``max_memory``)."""
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError("empty")
    if len(parts) == 1 and ":" not in parts[0]:
        size_bytes(parts[0])
        return dict.fromkeys(range(gpus), parts[0]) if gpus else {"cpu": parts[0]}
    out: dict[int | str, str] = {}
    for part in parts:
        if ":" not in part:
            raise ValueError(f"{part!r} has no device; write DEVICE:SIZE")
        device, size = (x.strip() for x in part.split(":", 1))
        size_bytes(size)
        if device.lower() == "cpu":
            out["cpu"] = size
        elif device.isdigit():
            out[int(device)] = size
        else:
            raise ValueError(f"{device!r} is not a GPU index or cpu")
    return out


def device_map_choice(text: str) -> str:
    value = text.strip()
    if value in DEVICE_MAP_CHOICES or re.fullmatch(r"cuda:\d+", value):
        return value
    raise argparse.ArgumentTypeError(f"{text!r} is not a device map; choose {', '.join(DEVICE_MAP_CHOICES)} or cuda:N")


@dataclass(frozen=True)
class Option:
    """One option, declared once: its setting (``dest``, a field of Settings), its command-line
    flag, whether it is an ini key ``layerparity_<dest>`` too (``ini``) or only (``cli=False``:
    ``flag`` is then the flag it had, refused with the key to write), its parser and default."""

    dest: str
    flag: str
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    ini: bool = False
    action: str | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    cli: bool = True

    def __post_init__(self) -> None:
        if not (self.cli or self.ini):
            raise ValueError(f"{self.dest}: an option off the command line must be an ini key")

    @property
    def ini_name(self) -> str:
        return f"layerparity_{self.dest}"

    @property
    def option_name(self) -> str:
        """Its name in pytest's option namespace (``config.getoption``)."""
        return f"layerparity_{self.dest}"

    @property
    def value_type(self) -> Any:
        """The type of its setting: bool, int, float or str (None where its default is None)."""
        if self.action == "store_true":
            kind: Any = bool
        elif self.type is None:
            kind = str
        else:
            kind = get_type_hints(self.type).get("return", str)
        return kind | None if self.default is None else kind


OPTIONS = (
    Option(
        "gpu_golden",
        "--gpu-golden",
        "Run the reference model (CUDA when visible, else CPU). With --extract, write goldens; without, check the "
        "stored goldens reproduce.",
        action="store_true",
        default=False,
    ),
    Option(
        "extract",
        "--extract",
        "With --gpu-golden: write golden references for the selected layers.",
        action="store_true",
        default=False,
    ),
    Option(
        "golden_device",
        "--golden-device",
        f"Device of the reference run: {GOLDEN_DEVICES_HELP}. Default: auto.",
        type=golden_device,
        default="auto",
        ini=True,
        metavar="DEVICE",
    ),
    Option(
        "xla",
        "--xla",
        "Run each layer on the torch-xla device (same as --target xla).",
        action="store_true",
        default=False,
    ),
    Option(
        "neuron",
        "--neuron",
        "Test NxDI's port of the architecture compiled for NeuronCores (same as --port nxdi --target neuron; "
        "with a conftest's pytest_layerparity_build_target_layer, or --port hf, its port runs eagerly on the "
        "NeuronCore through torch-neuronx).",
        action="store_true",
        default=False,
    ),
    Option(
        "target",
        "--target",
        "Device to test the port on. Default: none (no parity tests).",
        choices=("cpu", "cuda", "xla", "neuron"),
        default=None,
    ),
    Option(
        "port",
        "--port",
        "Whose implementation of each layer is under test: hf (the model's own HuggingFace layer, or the port a "
        "conftest's build hook returns) or nxdi (the neuronx-distributed-inference port of the architecture, built "
        "as NxDI builds it: with --target cpu eagerly in NxD's CPU mode, with --target neuron compiled through NxDI's "
        "build_module). Default: nxdi with --neuron (or --target neuron), unless a conftest implements "
        "pytest_layerparity_build_target_layer (then hf: the conftest's own port); hf otherwise.",
        choices=("hf", "nxdi"),
        default=None,
        ini=True,
    ),
    Option(
        "nxdi_app",
        "--nxdi-app",
        "With --port nxdi: the NxDI application class of a port outside NxDI's tree (package.module:Class, e.g. a "
        "contributed model's NeuronMiniMaxM2ForCausalLM). Default: NxDI's class for the model_type.",
        default=None,
        ini=True,
        cli=False,
        metavar="MODULE:CLASS",
    ),
    Option(
        "model",
        "--model",
        "HuggingFace model folder (config.json + safetensors). Default: ini layerparity_model.",
        default=None,
        ini=True,
        metavar="DIR",
    ),
    Option(
        "golden_dir",
        "--golden-dir",
        "Golden store folder. Default: ini layerparity_golden_dir, else layerparity-goldens/<model folder name>.",
        default=None,
        ini=True,
        metavar="DIR",
    ),
    Option(
        "layers",
        "--layers",
        "Layers to test: 17, 0-30, 0-5,10,20-25 or all. Default: all.",
        default="all",
        ini=True,
        metavar="SPEC",
    ),
    Option(
        "layer_ranges",
        "--layer-ranges",
        "Also test ranges run end to end from the golden input of their first layer, e.g. 0-5,6-11. Default: none.",
        default=None,
        metavar="SPEC",
    ),
    Option(
        "layer_module",
        "--layer-module",
        "Dotted path of the layer list when it is not found automatically (e.g. encoder.layer). Default: found "
        "automatically.",
        default=None,
        ini=True,
        cli=False,
        metavar="PATH",
    ),
    Option(
        "seq_len",
        "--seq-len",
        "Tokens per sequence of the golden input. Default: 32.",
        type=positive_int,
        default=32,
        ini=True,
        metavar="N",
    ),
    Option(
        "decode_steps",
        "--decode-steps",
        "Extraction: after the prompt, run N greedy decode steps (one token each, with the KV cache) and store "
        "every selected layer's call in each step, for the decode-step tests. 0: prompt only. Default: 2.",
        type=non_negative_int,
        default=2,
        ini=True,
        metavar="N",
    ),
    Option(
        "logits_topk",
        "--logits-topk",
        "Extraction: keep the model's next-token logits at every prompt and decode position as the top-K ids and "
        "logits plus the log-sum-exp, with their noise envelope, for test_model_parity (whole model, not under "
        "--device-map stream). 0: no whole-model golden. Default: 16.",
        type=non_negative_int,
        default=16,
        ini=True,
        cli=False,
        metavar="K",
    ),
    Option(
        "batch_size",
        "--batch-size",
        "Sequences in the golden input. Default: 1.",
        type=positive_int,
        default=1,
        ini=True,
        metavar="N",
    ),
    Option(
        "seed",
        "--seed",
        "Seed of the golden input token ids. Default: 0.",
        type=non_negative_int,
        default=0,
        ini=True,
        cli=False,
        metavar="N",
    ),
    Option(
        "prompt",
        "--prompt",
        "Use this text through the model's tokenizer as the golden input instead of random token ids. Default: none.",
        default=None,
        metavar="TEXT",
    ),
    Option(
        "dtype",
        "--dtype",
        f"Dtype of the reference run and the port: {', '.join(DTYPES)}. Default: the checkpoint's own (dtype or "
        "torch_dtype in config.json, as transformers' 'auto' reads it; float32 when it names none); the stored "
        "golden's dtype when testing.",
        type=dtype_name,
        default=None,
        ini=True,
    ),
    Option(
        "max_abs_diff",
        "--max-abs-diff",
        "Fail when max_abs_diff is above this. Default: 0.01.",
        type=tolerance,
        default=0.01,
        ini=True,
        cli=False,
        metavar="X",
    ),
    Option(
        "max_mean_abs_diff",
        "--max-mean-abs-diff",
        "Fail when mean_abs_diff is above this. Default: 0.001.",
        type=tolerance,
        default=0.001,
        ini=True,
        cli=False,
        metavar="X",
    ),
    Option(
        "min_similarity",
        "--min-similarity",
        "Fail when similarity_percentage (share of elements with |target - golden| <= 0.01 + 0.01 * |golden|) is "
        "below this. Default: 95.",
        type=percentage,
        default=95.0,
        ini=True,
        cli=False,
        metavar="PCT",
    ),
    Option(
        "min_cosine",
        "--min-cosine",
        "Fail when cosine_similarity is below this. Default: 0.99 (noise policy, float32 goldens: 0.9999).",
        type=correlation,
        default=None,
        ini=True,
        cli=False,
        metavar="X",
    ),
    Option(
        "min_pearson",
        "--min-pearson",
        "Fail when pearson_correlation is below this. Default: 0.99.",
        type=correlation,
        default=0.99,
        ini=True,
        cli=False,
        metavar="X",
    ),
    Option(
        "verdict",
        "--verdict",
        "Verdict policy: noise (error in units of the golden's own rounding error, against the stored float32 "
        "evaluation) or table (the fixed thresholds above). Default: noise.",
        choices=("noise", "table"),
        default="noise",
        ini=True,
    ),
    Option(
        "max_noise_ratio",
        "--max-noise-ratio",
        "Noise policy: fail when ||target - ref|| / ||golden - ref|| is above this. Default: 1.5.",
        type=tolerance,
        default=None,
        ini=True,
        cli=False,
        metavar="X",
    ),
    Option(
        "max_token_noise_ratio",
        "--max-token-noise-ratio",
        "Noise policy: fail when any token's noise ratio is above this. Default: 3.",
        type=tolerance,
        default=None,
        ini=True,
        cli=False,
        metavar="X",
    ),
    Option(
        "max_contribution_z",
        "--max-contribution-bias",
        "Noise policy: fail when the target's error along the layer's own contribution (output - input) is more than "
        "this many noise units. Default: 6.",
        type=tolerance,
        default=None,
        ini=True,
        cli=False,
        metavar="Z",
    ),
    Option(
        "false_alarm_rate",
        "--false-alarm-rate",
        "Noise policy: the probability that a correct layer fails, from which the limits are drawn out of the "
        "layer's noise envelope. Default: 0.001.",
        type=probability,
        default=1e-3,
        ini=True,
        cli=False,
        metavar="P",
    ),
    Option(
        "envelope_samples",
        "--envelope-samples",
        "Perturbed runs (Monte Carlo arithmetic) of each layer that make its noise envelope, at extraction and "
        "for each chained run (the whole model's envelope takes half as many and one); 0: none (fixed limits). "
        "Default: 12.",
        type=non_negative_int,
        default=12,
        ini=True,
        metavar="K",
    ),
    Option(
        "near_ties",
        "--near-ties",
        "Tokens whose MoE routing flipped on a near tie: leave-out (reported, and left out of the noise policy's "
        "checks), exclude (left out of the output metrics too) or strict (counted in the verdict like any other "
        "token). Default: leave-out.",
        choices=NEAR_TIES,
        default="leave-out",
        ini=True,
    ),
    Option(
        "router_tie_tolerance",
        "--router-tie-tolerance",
        "A router margin (gap between the k-th and k+1-th logit over the largest) below this many units of the "
        "dtype's epsilon is a near tie. Default: 8.",
        type=tolerance,
        default=8.0,
        ini=True,
        cli=False,
        metavar="N",
    ),
    Option(
        "no_precision_floor",
        "--no-precision-floor",
        "Extraction: skip the higher-precision evaluation of each layer (the noise policy then falls back to the "
        "table policy for these goldens).",
        action="store_true",
        default=False,
    ),
    Option(
        "force_regen",
        "--force-regen",
        "Extraction: replace the golden store with this extraction even when it holds goldens of another one; the "
        "old store is kept aside (DIR.previous) until every extraction test has passed, and put back otherwise.",
        action="store_true",
        default=False,
    ),
    Option(
        "device_map",
        "--device-map",
        "Placement of the reference model: stream (one layer at a time from the shards), auto, balanced, "
        "balanced_low_0, sequential, cpu or cuda:N (whole model through accelerate). Default: whole model on the "
        "golden device when it fits, else stream.",
        type=device_map_choice,
        default=None,
        ini=True,
        metavar="MAP",
    ),
    Option(
        "max_memory",
        "--max-memory",
        "Memory budget per device for whole-model placement: 40GB, 0:60GB,1:60GB,2:40GB or cpu:100GB. Default: what "
        "is free.",
        type=max_memory_spec,
        default=None,
        ini=True,
        cli=False,
        metavar="SPEC",
    ),
    Option(
        "offload_folder",
        "--offload-folder",
        "Folder for weights accelerate offloads to disk in whole-model placement. Default: none.",
        default=None,
        ini=True,
        cli=False,
        metavar="DIR",
    ),
    Option(
        "plan",
        "--plan",
        "Print the memory plan (weights by dtype, largest layer, activations, KV cache, devices, which placement "
        "fits) from config.json and the safetensors headers, and exit.",
        action="store_true",
        default=False,
    ),
    Option(
        "parity_report",
        "--parity-report",
        "Write report.json, report.csv and report.html (table and metric plots across layers) into this folder. "
        "Default: none.",
        default=None,
        metavar="DIR",
    ),
    Option(
        "save_outputs",
        "--save-outputs",
        "Keep the target's per-layer outputs in this folder, in the golden format (for python -m pytest_layerparity "
        "compare). Default: none.",
        default=None,
        metavar="DIR",
    ),
    Option(
        "chain",
        "--chain",
        "Also run the selected layers as chains on the target (each contiguous run, fed the target's own output), "
        "comparing every layer: the accumulated drift.",
        action="store_true",
        default=False,
    ),
    Option(
        "bisect",
        "--bisect",
        "Also bisect each contiguous run of selected layers to the first layer whose chained output leaves "
        "tolerance, in O(log n) chained range runs.",
        action="store_true",
        default=False,
    ),
    Option(
        "op_compare",
        "--op-compare",
        "Re-run each failing layer op by op under CompareWithCPU (target device against the CPU) with the module "
        "tracker, and report the first op that fails, its module path and the command that replays its dump.",
        action="store_true",
        default=False,
    ),
    Option(
        "op_compare_dir",
        "--op-compare-dir",
        "Where --op-compare writes the failing op's dump. Default: layerparity-opcompare/.",
        default=None,
        ini=True,
        cli=False,
        metavar="DIR",
    ),
    Option(
        "op_atol",
        "--op-atol",
        "--op-compare: absolute tolerance of one op against the CPU. Default: per dtype (bf16 1e-2, fp16 1e-3, fp32 "
        "1e-4).",
        type=tolerance,
        default=None,
        ini=True,
        cli=False,
        metavar="X",
    ),
    Option(
        "op_rtol",
        "--op-rtol",
        "--op-compare: relative tolerance of one op against the CPU. Default: per dtype (bf16 1.6e-2, fp16 1e-3, "
        "fp32 1e-4).",
        type=tolerance,
        default=None,
        ini=True,
        cli=False,
        metavar="X",
    ),
    Option(
        "tp_degree",
        "--tp-degree",
        "Tensor-parallel degree: of NxDI's layers sharded over torchrun ranks in NxD's CPU mode (--port nxdi --target "
        "cpu: one rank per shard), of a layer run eagerly on Neuron (--neuron --port hf: neuronx-distributed "
        "parallel_state; one torchrun rank per NeuronCore), "
        "or of each program compiled under --port nxdi --target neuron (one process over N NeuronCores). Default: 1.",
        type=positive_int,
        default=1,
        ini=True,
        metavar="N",
    ),
    Option(
        "ep_degree",
        "--ep-degree",
        "With --port nxdi --target neuron: expert parallelism of a MoE port's compiled programs (NxDI's "
        "moe_ep_degree; the experts' tensor parallelism is then --tp-degree / N). Not in NxD's CPU mode, which "
        "makes no expert-parallel groups. Default: 1.",
        type=positive_int,
        default=1,
        ini=True,
        cli=False,
        metavar="N",
    ),
    Option(
        "logical_nc_config",
        "--logical-nc-config",
        "With --neuron: the logical NeuronCore config of parallel_state's tensor-parallel groups, and with --port "
        "nxdi NxDI's logical_nc_config of the compiled programs and their sharding alike (2 on Trn2 with LNC2). "
        "Default: what NxDI's NeuronConfig resolves (NEURON_LOGICAL_NC_CONFIG, else the platform's: 2 on Trn2, "
        "1 on Trn1).",
        type=positive_int,
        default=None,
        ini=True,
        cli=False,
        metavar="N",
    ),
    Option(
        "experts_implementation",
        "--experts-implementation",
        "MoE experts implementation of the layers built for the target (transformers': eager, batched_mm, "
        "grouped_mm). Default: eager on torch-xla and Neuron (grouped_mm does not run there), the model's elsewhere.",
        default=None,
        ini=True,
        cli=False,
        metavar="NAME",
    ),
    Option(
        "attn_implementation",
        "--attn-implementation",
        "Attention implementation of the reference model (eager, sdpa, ...). Default: the model's, but eager where "
        "attention logits are soft-capped (Gemma-2: SDPA leaves the capping out under transformers before 5.24).",
        default=None,
        ini=True,
        cli=False,
        metavar="NAME",
    ),
    Option(
        "trust_remote_code",
        "--trust-remote-code",
        "Allow the model folder's own modeling code (transformers trust_remote_code): true or false. Default: false.",
        type=boolean,
        default=False,
        ini=True,
        cli=False,
        metavar="true",
    ),
    Option(
        "cores_per_worker",
        "--cores-per-worker",
        "With -n N and --neuron: NeuronCores each xdist worker gets (NEURON_RT_VISIBLE_CORES, taken in order from "
        "the visible cores); 0 leaves a single worker unpinned (refused with several). Default: 1.",
        type=non_negative_int,
        default=1,
        ini=True,
        cli=False,
        metavar="N",
    ),
    Option(
        "compile_cache",
        "--compile-cache",
        "Keep compiled graphs in this folder between sessions: torch-xla's persistent cache with --xla, Neuron's "
        "compile cache (NEURON_COMPILE_CACHE_URL) with --neuron. Default: none.",
        default=None,
        ini=True,
        metavar="DIR",
    ),
)


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("layerparity", "per-layer parity of model ports (pytest-layerparity)")
    for opt in OPTIONS:
        if opt.cli:
            kwargs: dict[str, Any] = {"dest": opt.option_name, "help": opt.help}
            if opt.action:
                kwargs["action"] = opt.action
                kwargs["default"] = opt.default
            else:
                kwargs["default"] = None  # None means "not given": the ini key or the default applies
                if opt.type is not None:
                    kwargs["type"] = opt.type
                if opt.choices:
                    kwargs["choices"] = opt.choices
                if opt.metavar:
                    kwargs["metavar"] = opt.metavar
            group.addoption(opt.flag, **kwargs)
        if opt.ini:
            help_text = (
                f"Default of {opt.flag}: {opt.help}"
                if opt.cli
                else f"{opt.help} For one run: -o {opt.ini_name}={opt.metavar or 'VALUE'} (was {opt.flag})."
            )
            parser.addini(opt.ini_name, help=help_text, default=None)


#: The flags that left the command line, and what to type instead.
MOVED_FLAGS = {opt.flag: opt for opt in OPTIONS if not opt.cli}
REPLACED_FLAGS = {"--exclude-near-ties": "--near-ties exclude", "--strict-routing": "--near-ties strict"}


def moved_flag_fixes(args: Sequence[str]) -> dict[str, str]:
    """For each flag in ``args`` that is an ini key now (or part of another option): what to
    type instead, with the value it was given."""
    fixes: dict[str, str] = {}
    for i, arg in enumerate(args):
        flag, equals, value = arg.partition("=")
        if flag in REPLACED_FLAGS:
            fixes[flag] = f"{flag} is now {REPLACED_FLAGS[flag]}"
        opt = MOVED_FLAGS.get(flag)
        if opt is None:
            continue
        if opt.type is boolean:
            value = value or "true"
        elif not equals:
            following = args[i + 1] if i + 1 < len(args) else ""
            given = following and (not following.startswith("-") or _is_number(following))
            value = following if given else (opt.metavar or "VALUE")
        setting = shlex.quote(f"{opt.ini_name}={value}")
        fixes[flag] = (
            f"{flag} is an ini key now: set {opt.ini_name} in the project's pytest ini, or for one run write "
            f"-o {setting}"
        )
    return fixes


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def refuse_moved_flags(parser: pytest.Parser, args: Sequence[str]) -> None:
    """Raise UsageError, naming the ini key and ``-o``, for a flag of this table that left the
    command line (unless another plugin or a conftest declares a flag by that name)."""
    fixes = moved_flag_fixes(args)
    if not fixes:
        return
    _, unknown = parser.parse_known_and_unknown_args(args)
    unknown_flags = {arg.partition("=")[0] for arg in unknown}
    refused = [fix for flag, fix in fixes.items() if flag in unknown_flags]
    if refused:
        raise pytest.UsageError("; ".join(refused))


class _SettingsMethods:
    """What Settings works out from its values."""

    @property
    def target_name(self) -> str | None:
        if self.xla:
            return "xla"
        if self.neuron:
            return "neuron"
        return self.target

    @property
    def compiled(self) -> bool:
        """NxDI's port compiled through build_module, one program per layer kind (--port nxdi --target neuron)."""
        return self.port == "nxdi" and self.target_name == "neuron"

    @property
    def mode(self) -> str | None:
        """'extract', 'verify' (re-run the reference against the store), 'parity' or None."""
        if self.gpu_golden:
            return "extract" if self.extract else "verify"
        if self.target_name:
            return "parity"
        return None


#: Every option's effective value (command line over ini over default), one field per entry
#: of OPTIONS; plain values (bool, int, float, str or None).
Settings = make_dataclass(
    "Settings",
    [(opt.dest, opt.value_type) for opt in OPTIONS],
    bases=(_SettingsMethods,),
    frozen=True,
    namespace={"__module__": __name__, "__doc__": "Every option's effective value, one field per option."},
)


def make_settings(**values: Any) -> Settings:
    """Settings with every option at its default except ``values`` (for use without pytest:
    scripts, benchmarks, ``python -m pytest_layerparity``)."""
    base = {opt.dest: opt.default for opt in OPTIONS}
    unknown = set(values) - set(base)
    if unknown:
        raise TypeError(f"unknown settings: {', '.join(sorted(unknown))}")
    base.update(values)
    if base["port"] is None:
        base["port"] = default_port(base["target"], base["xla"], base["neuron"], own_port=False)
    return Settings(**base)


def default_port(target: str | None, xla: bool, neuron: bool, own_port: bool) -> str:
    """The port under test when --port is not given: NxDI's on Neuron (``--neuron`` is
    ``--port nxdi --target neuron``), except where a conftest supplies its own layer."""
    on_neuron = neuron or (target == "neuron" and not xla)
    return "nxdi" if on_neuron and not own_port else "hf"


def conftest_builds_layer(config: pytest.Config) -> bool:
    """Whether a conftest (or plugin) implements ``pytest_layerparity_build_target_layer``:
    its own port of the layer."""
    hook = getattr(config.pluginmanager.hook, "pytest_layerparity_build_target_layer", None)
    return bool(hook is not None and hook.get_hookimpls())


def overridden_ini_keys(config: pytest.Config) -> set[str]:
    """The ini keys given on the command line with ``-o NAME=VALUE``."""
    overrides = getattr(config.option, "override_ini", None) or ()
    return {item.partition("=")[0].strip() for item in overrides}


def read_settings(config: pytest.Config) -> Settings:
    from_cli = overridden_ini_keys(config)
    values = {}
    for opt in OPTIONS:
        value = config.getoption(opt.option_name) if opt.cli else None
        if value is None and opt.ini:
            raw = config.getini(opt.ini_name)
            if raw not in (None, "", []):
                value = _parse_ini(opt, raw, opt.ini_name in from_cli)
        values[opt.dest] = opt.default if value is None else value
    if values["port"] is None:
        own = conftest_builds_layer(config)
        values["port"] = default_port(values["target"], values["xla"], values["neuron"], own)
    return Settings(**values)


PATH_OPTIONS = (
    "model",
    "golden_dir",
    "parity_report",
    "save_outputs",
    "offload_folder",
    "op_compare_dir",
    "compile_cache",
)


def is_url(location: str) -> bool:
    return "://" in location


def resolve_cache_location(value: str, base: Path) -> str:
    """A local folder made absolute against ``base``; URLs (s3://, for Neuron's compile
    cache) are kept as they are."""
    if is_url(value) or Path(value).is_absolute():
        return value
    return str(base / value)


def resolve_paths(settings: Settings, config: pytest.Config) -> Settings:
    """Make path options absolute: command-line values (flags and ``-o``) against the directory
    pytest was started in, ini values against the ini file's directory (URLs stay as they are)."""
    changes = {}
    overridden = overridden_ini_keys(config)
    for opt in OPTIONS:
        if opt.dest not in PATH_OPTIONS:
            continue
        value = getattr(settings, opt.dest)
        if not value:
            continue
        from_cli = (opt.cli and config.getoption(opt.option_name) is not None) or opt.ini_name in overridden
        base = config.invocation_params.dir if from_cli or config.inipath is None else config.inipath.parent
        resolved = resolve_cache_location(value, Path(base))
        if resolved != value:
            changes[opt.dest] = resolved
    return replace(settings, **changes)


INI_FILES = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")


def check_ini_not_lost(config: pytest.Config) -> None:
    """Refuse a run whose ini file pytest skipped because of how a path option was written.

    pytest chooses its rootdir and ini file before plugins' options are known, so in
    ``--golden-dir /data/goldens`` it takes ``/data/goldens`` for a test path, looks for an
    ini above it, and (finding none) runs without the project's ``layerparity_*`` settings.
    """
    if config.inipath is not None:
        return
    by_flag = {opt.flag: opt for opt in OPTIONS if opt.dest in PATH_OPTIONS and opt.cli}
    args = list(config.invocation_params.args)
    split = [
        (flag, args[i + 1])
        for i, flag in enumerate(args[:-1])
        if flag in by_flag and Path(config.invocation_params.dir, args[i + 1]).exists()
    ]
    if not split:
        return
    start = Path(config.invocation_params.dir)
    for folder in (start, *start.parents):
        for name in INI_FILES:
            ini = folder / name
            try:
                text = ini.read_text(errors="replace") if ini.is_file() else ""
            except OSError:
                continue
            if "layerparity_" in text:
                flag, value = split[0]
                raise pytest.UsageError(
                    f"pytest read no ini file: it took {value} (the value of {flag}) for a test path when it "
                    "chose its rootdir, which it does before plugins' options are known, so the layerparity "
                    f"settings in {ini} were not read; write {flag}={value}, or add -c {ini}"
                )


def _parse_ini(opt: Option, raw: Any, from_cli: bool = False) -> Any:
    """An ini value (or ``-o NAME=VALUE``) parsed as the flag's value would be; a malformed
    one is a usage error that says what to write."""
    text = raw if isinstance(raw, str) else str(raw)
    where = f"-o {opt.ini_name}={text}" if from_cli else f"ini option {opt.ini_name} = {text!r}"
    if opt.choices and text.strip() not in opt.choices:
        raise pytest.UsageError(f"{where}: {text!r} is not one of {', '.join(opt.choices)}")
    if opt.type is None:
        return text.strip() if opt.choices else text
    try:
        return opt.type(text)
    except argparse.ArgumentTypeError as exc:
        raise pytest.UsageError(f"{where}: {exc}") from None
