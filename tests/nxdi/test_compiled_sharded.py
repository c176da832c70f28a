"""``--port nxdi --target neuron --tp-degree N``: each layer's program built over N ranks and run
SPMD on the stand-in's rank processes (every rank the same inputs, the collectives between them,
rank 0's outputs returned, as NxD's compiled model returns them). NxDI's attention holds its
own rank's KV heads: the decode steps' past goes in as the ranks hold it, and the keys and
values each rank makes are gathered before they are returned. Held against the same layers
run sharded in NxD's CPU mode under torchrun (one process per rank)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from test_compiled_port import builds, loads, run
from test_sharded import BUGS, HERE
from test_sharded import run as run_cpu_mode


def metrics(path: Path) -> dict[tuple[str, str], float]:
    """Each test's numeric JUnit properties, by (test, property)."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        for prop in case.iter("property"):
            try:
                out[case.get("name", ""), prop.get("name", "")] = float(prop.get("value", ""))
            except ValueError:
                continue
    return out


@pytest.mark.parametrize(
    ("name", "dtype", "tp"),
    [
        ("qwen3_moe", "float32", 1),  # Llama's and Mixtral's at tp 1: test_compiled_port.py
        ("llama", "float32", 2),
        ("mixtral", "float32", 2),
        ("qwen3_moe", "float32", 2),
        ("llama", "bfloat16", 4),  # 2 KV heads replicated to 4
        ("mixtral", "float32", 4),
        ("qwen3_moe", "float32", 4),
    ],
)
def test_compiled_port_sharded_computes_what_the_cpu_modes_sharded_run_does(pytester, name, dtype, tp):
    compiled = run(pytester, name, dtype, f"--tp-degree={tp}", "--junitxml=compiled.xml")
    compiled.assert_outcomes(passed=5)  # 2 layers' prompt, their decode steps, the whole model
    compiled.stdout.fnmatch_lines([f"layerparity: port NxDI port *(tp_degree {tp}, logical_nc_config 1 *"])
    made = builds(pytester)
    assert len(made) == 2 and all(b["tp_degree"] == tp for b in made)  # still one build per program
    (step,) = [b for b in made if len(b["example"]) == 5]
    # the past as the ranks hold it, rank after rank: the models' 2 KV heads, 1 on each rank from tp 2
    assert step["example"][3][0][1] == max(tp, 2)
    assert all(x["ranks"] == tp for x in loads(pytester))  # each weight swap: one state dict per rank
    cpu_mode = run_cpu_mode(pytester, name, dtype, tp if tp > 1 else 0, "--junitxml=cpu_mode.xml")
    assert cpu_mode.ret == 0, cpu_mode.stdout.str()
    ours, theirs = metrics(pytester.path / "compiled.xml"), metrics(pytester.path / "cpu_mode.xml")
    for key in ("noise_ratio", "max_abs_diff", "cosine_similarity"):
        pairs = {k: v for k, v in theirs.items() if k[1] == key}
        assert len(pairs) == 4
        # within float rounding: the decode steps' padded KV cache sums in another order
        assert {k: ours[k] for k in pairs} == pytest.approx(pairs, rel=0.02, abs=1e-6)


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_sharding_bug_fails_the_compiled_port_in_its_layer(pytester, monkeypatch, bug):
    name, app = BUGS[bug]
    monkeypatch.setenv("PYTHONPATH", str(HERE))
    app_option = ("-o", f"layerparity_nxdi_app=sharding_bugs.{app}")
    result = run(pytester, name, "float32", "--tp-degree=2", *app_option, "-k", "test_layer_parity", "-rf")
    result.assert_outcomes(passed=1, failed=1)
    failed = [line.split()[1] for line in result.stdout.lines if line.startswith("FAILED ")]
    assert failed == ["layerparity::test_layer_parity[layer_1]"]
