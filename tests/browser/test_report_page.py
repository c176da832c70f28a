"""report.html as a reader sees it: opened in headless Chromium after a real run with one
failing layer and a chained run; and laid out in a 1400 px window when its table is wider than
that, its failure text is long and one layer's values are decades above the others'."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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

PLANT_SCALE = """
import pytest

@pytest.hookimpl
def pytest_layerparity_build_target_layer(layer_idx, reference_layer, model_config, device):
    if layer_idx == 3:
        reference_layer.self_attn.o_proj.weight.data.mul_(1000.0)  # the bug: a weight left unscaled
    return reference_layer.to(device)
"""

#: Goldens deep in a shared folder: the failure text's drill-in command carries their path, a
#: word wider than the window.
DEEP_GOLDENS = "/".join(["goldens", *["minimax_m2_tiny-bfloat16-prompt-goldens-from-the-gpu-runner"] * 4])


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
    # the failures pictured: layer 3's and the chain's (at its first failing layer, 3)
    assert len(seen["pictures"]) == 2
    for picture in seen["pictures"]:
        assert "largest per-token ratio" in picture["caption"]
        assert [c["name"] for c in picture["charts"]] == ["histogram", "per-token", "per-channel"]
        assert all(c["width"] >= 300 and c["height"] >= 150 and c["marks"] >= 3 for c in picture["charts"])
    (plot,) = seen["images"]
    assert plot["complete"] and plot["naturalWidth"] > 300 and plot["naturalHeight"] > 200  # decoded, not broken
    assert plot["shownWidth"] > 300
    assert (tmp_path / "report.png").stat().st_size > 20_000  # the screenshot, for a look by hand


@pytest.fixture
def screenshot(tmp_path: Path) -> Path:
    """Where the page's screenshot goes: report.png in $LAYERPARITY_ARTIFACTS (relative to the
    repository root) for CI to keep, else in tmp_path."""
    folder = ROOT / os.environ["LAYERPARITY_ARTIFACTS"] if os.environ.get("LAYERPARITY_ARTIFACTS") else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "report.png"


def test_report_page_fits_a_1400px_window_with_a_wide_table_long_failure_text_and_an_outlier(pytester, screenshot):
    default_project(pytester, decode=False, goldens=DEEP_GOLDENS)
    pytester.makeconftest(PLANT_SCALE)
    result = pytester.runpytest_subprocess("--target", "cpu", "--layers", "1-4", "--parity-report", "rep")
    result.assert_outcomes(passed=3, failed=1)
    report = {t["layers"]: t for t in json.loads((pytester.path / "rep" / "report.json").read_text())["tests"]}
    noise = {layer: t["metrics"]["noise_ratio"] for layer, t in report.items()}
    assert noise["3"] > 1000 * max(noise["1"], noise["2"], noise["4"])  # one layer's value spans decades
    assert str(pytester.path / DEEP_GOLDENS) in report["3"]["message"]

    seen = look_at(pytester.path / "rep" / "report.html", screenshot)
    layout = seen["layout"]
    assert seen["ok"] and seen["errors"] == [], seen["errors"]
    assert layout["innerWidth"] == 1400
    assert layout["pageScrollWidth"] <= 1400 and layout["wider"] == []  # the page never scrolls sideways
    box = layout["box"]
    assert (box["tag"], box["overflowX"]) == ("div.table-box", "auto") and box["right"] <= 1400
    assert box["scrollWidth"] > box["clientWidth"]  # the table is wider than the window: it scrolls in its box
    (failure,) = layout["failures"]
    assert failure["text"] == report["3"]["message"]
    assert failure["scrollWidth"] <= failure["clientWidth"] and failure["right"] <= box["right"]
    assert failure["lines"] > len(failure["text"].splitlines())  # its long lines wrap

    scrolled = layout["scrolled"]
    assert scrolled["scrollLeft"] > 0 and scrolled["column"]["onTop"]  # token_noise_ratio can be scrolled to
    assert scrolled["boxLeft"] <= scrolled["column"]["left"] and scrolled["column"]["right"] <= scrolled["boxRight"]
    assert len(scrolled["firstColumn"]) == 1 + len(report)  # the header and a row per test
    for cell in scrolled["firstColumn"]:  # the test id stays at the box's left, over the scrolled cells
        assert cell["position"] == "sticky" and cell["onTop"], cell
        assert cell["left"] == scrolled["boxLeft"] and cell["background"] != "rgba(0, 0, 0, 0)", cell
    (failure,) = scrolled["failures"]
    assert scrolled["boxLeft"] <= failure["left"] and failure["right"] <= scrolled["boxRight"]  # still in view

    (picture,) = seen["pictures"]  # the one failing layer's, its charts laid out within the window
    assert [c["name"] for c in picture["charts"]] == ["histogram", "per-token", "per-channel"]
    (plot,) = seen["images"]  # noise_ratio 1.2e5 against 1: a log axis, so that the envelope band shows
    assert plot["alt"] == (
        "metrics across layers; y axes: max_abs_diff (symlog), mean_abs_diff (symlog), 1 - cosine_similarity (log), "
        "1 - pearson_correlation (log), noise_ratio (log), token_noise_ratio (log), contribution_bias (symlog)"
    )
    assert screenshot.stat().st_size > 20_000
