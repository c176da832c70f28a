"""``--port nxdi --target cpu --tp-degree N`` under torchrun: NxDI's layers sharded over N gloo
ranks in NxD's CPU mode (``get_sharded_checkpoint`` per rank, the KV cache split to each rank's
heads and gathered back), and sharding bugs that only show sharded."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from make_nxdi_fixtures import checkpoint, golden_dir

HERE = Path(__file__).resolve().parent


def run(pytester: pytest.Pytester, name: str, dtype: str, tp: int, *args: str) -> pytest.RunResult:
    """pytest over ``tp`` torchrun ranks (``tp`` 0: one process, no torchrun)."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp)]
    command = [*(launch if tp else [sys.executable]), "-m", "pytest", "-p", "no:cacheprovider"]
    return pytester.run(
        *command,
        "--port",
        "nxdi",
        "--target",
        "cpu",
        f"--tp-degree={max(tp, 1)}",
        f"--model={checkpoint(name)}",
        f"--golden-dir={golden_dir(name, dtype)}",
        *args,
    )


def noise_ratios(path: Path) -> dict[str, float]:
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        for prop in case.iter("property"):
            if prop.get("name") == "noise_ratio":
                out[case.get("name", "")] = float(prop.get("value", "nan"))
    return out


@pytest.mark.parametrize(
    ("name", "dtype", "tp", "heads"),
    [
        ("llama", "float32", 2, "KV heads: 2 KV heads, 1 on each rank"),
        ("mixtral", "float32", 2, "KV heads: 2 KV heads, 1 on each rank"),
        ("llama", "bfloat16", 4, "KV heads: 2 KV heads as 4 (REPLICATE_TO_TP_DEGREE), 1 on each rank"),
    ],
)
def test_a_correct_port_sharded_over_torchrun_ranks_passes_and_really_is_sharded(pytester, name, dtype, tp, heads):
    sharded = run(pytester, name, dtype, tp, "--junitxml=sharded.xml")
    assert sharded.ret == 0, sharded.stdout.str()
    sharded.stdout.fnmatch_lines(
        [
            f"layerparity: port NxDI port * NxD CPU mode, tensor parallelism {tp} over {tp} torchrun ranks (gloo; "
            f"bfloat16 collectives too, which NxDI's to_cpu refuses at tp > 1), {heads}, no Neuron compile*",
            f"layerparity: torchrun rank 0 of {tp} *",
            "*5 passed*",  # 2 layers' prompt, their decode steps, the whole model
        ]
    )
    unsharded = run(pytester, name, dtype, 0, "--junitxml=unsharded.xml")
    assert unsharded.ret == 0
    one, many = noise_ratios(pytester.path / "unsharded.xml"), noise_ratios(pytester.path / "sharded.xml")
    assert one.keys() == many.keys() and len(one) == 4
    assert one != many  # the sharded layers' own rounding: they did run sharded


def test_tp_degree_without_torchrun_is_a_usage_error_with_the_launch_command(pytester):
    result = run(pytester, "llama", "float32", 0, "--tp-degree=2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: --port nxdi --target cpu: --tp-degree 2 shards each layer over 2 processes, one per rank, and "
            "this is one process; launch the ranks with: python -m torch.distributed.run --nproc-per-node 2 -m "
            "pytest --port nxdi --target cpu --tp-degree 2 ... (python -m torch.distributed.run from the NxDI "
            "environment: it has no torchrun script of its own)"
        ]
    )


def test_nxdi_convert_to_mha_defect_is_named_where_the_ranks_do_not_divide_the_kv_heads(pytester):
    result = run(pytester, "llama", "float32", 3, "-k", "test_layer_parity and layer_0")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "layer 0: NxDI's sharding failed at --tp-degree 3 (expected shape * but found *): 3 ranks do not divide "
            "the 2 KV heads, so NxDI converts them to multi-head attention (GQA.CONVERT_TO_MHA), replicating each KV "
            "head 2 times, then pads the replicated K/V projections as if they still held 2 heads "
            "(modules/attention/gqa.py: maybe_pad_tail with _src_num_key_value_heads after replicate_kv): a defect "
            "of NxDI's, not of the port; use a --tp-degree that divides the 2 KV heads or that they divide"
        ]
    )


BUGS = {
    "a row-parallel projection without its all-reduce": ("llama", "reduce_dropped:ReduceDroppedForCausalLM"),
    "KV heads placed for the wrong query group": ("llama", "kv_heads_misplaced:KvHeadsMisplacedForCausalLM"),
    "a fused gate/up tensor split in the wrong order": ("mixtral", "gate_up_unstrided:GateUpUnstridedForCausalLM"),
    "expert intermediate shards joined out of order": (
        "mixtral",
        "expert_shards_reversed:ExpertShardsReversedForCausalLM",
    ),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_sharding_bug_passes_unsharded_and_fails_sharded_in_its_layer(pytester, monkeypatch, bug):
    name, app = BUGS[bug]
    monkeypatch.setenv("PYTHONPATH", str(HERE))
    options = ("-o", f"layerparity_nxdi_app=sharding_bugs.{app}", "-k", "test_layer_parity")
    unsharded = run(pytester, name, "float32", 0, *options)
    unsharded.assert_outcomes(passed=2)
    sharded = run(pytester, name, "float32", 2, *options)
    assert sharded.ret == pytest.ExitCode.TESTS_FAILED
    sharded.stdout.fnmatch_lines(
        [
            "  control: the model's own layer on cpu*, on the same call, passes: the difference is the port's",
            "  unsharded (--tp-degree 1, run once more in one process) this test passes: the difference appears only "
            "sharded over 2 ranks (how the port splits or joins its weights, KV heads or partial sums)",
            "test_layer_parity[[]layer_0[]] * pass *",
            "test_layer_parity[[]layer_1[]] * fail *",
            "*1 failed, 1 passed*",
        ]
    )
