"""report.html as a reader sees it: opened in headless Chromium after a real run with one
failing layer and a chained run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from support import default_project  # noqa: E402

PLANT_EPSILON = """
import pytest

@pytest.hookimpl
def pytest_layerparity_build_target_layer(layer_idx, reference_layer, model_config, device):
    if layer_idx == 3:
        reference_layer.input_layernorm.variance_epsilon = 0.5  # the bug, in one layer
    return reference_layer.to(device)
"""


def look_at(page: Path, screenshot: Path) -> dict:
    done = subprocess.run(
        ["node", str(HERE / "look_at_page.mjs"), page.as_uri(), str(screenshot)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=HERE,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_report_page_loads_renders_its_plot_and_lists_every_test(pytester, tmp_path):
    default_project(pytester, decode=False)
    pytester.makeconftest(PLANT_EPSILON)
    result = pytester.runpytest_subprocess("--target", "cpu", "--layers", "1-4", "--chain", "--parity-report", "rep")
    result.assert_outcomes(passed=3, failed=2)  # layer 3, and chain 1-4 at layer 3 (its local checks)
    report = json.loads((pytester.path / "rep" / "report.json").read_text())

    seen = look_at(pytester.path / "rep" / "report.html", tmp_path / "report.png")

    assert seen["ok"] and seen["errors"] == [], seen["errors"]
    assert seen["browser"].startswith("HeadlessChrome/")
    assert seen["title"] == "layerparity report"
    assert seen["summary"] == ["First failing: test_layer_parity[layer_3] (layers 3)"]
    assert len(seen["rows"]) == len(report["tests"]) == 5  # one row per test
    failing = sorted(r["test"] for r in seen["rows"] if r["cls"] == "fail")
    assert failing == ["test_chain_parity[layers_1-4]", "test_layer_parity[layer_3]"]
    red, green = "rgb(198, 40, 40)", "rgb(46, 125, 50)"
    assert {r["color"] for r in seen["rows"] if r["cls"] == "fail"} == {red}
    assert {r["color"] for r in seen["rows"] if r["cls"] == "pass"} == {green}
    (plot,) = seen["images"]
    assert plot["complete"] and plot["naturalWidth"] > 300 and plot["naturalHeight"] > 200  # decoded, not broken
    assert plot["shownWidth"] > 300
    assert (tmp_path / "report.png").stat().st_size > 20_000  # the screenshot, for a look by hand
