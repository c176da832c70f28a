"""The options of how a run goes about it: placement and memory, what it writes, the deeper
looks at a failure (chains, bisection, op by op), parallelism and implementations."""

from __future__ import annotations

from .declaration import Option
from .parsers import (
    boolean,
    device_map_choice,
    max_memory_spec,
    non_negative_int,
    positive_int,
    tolerance,
)

TOOLING_OPTIONS = (
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
