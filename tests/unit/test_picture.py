"""A failing test's picture: its error per element beside the golden's own rounding, per token
and per channel, so that a one-token or one-channel error is seen at a glance."""

from __future__ import annotations

import torch

from pytest_layerparity.compare.judge import judge
from pytest_layerparity.compare.picture import EDGES, POINTS, FailurePicture, failure_picture
from pytest_layerparity.options import make_settings
from pytest_layerparity.report.entry import ReportEntry
from pytest_layerparity.report.files import write_report_html
from pytest_layerparity.report.properties import properties


def layer_output(tokens: int = 24, width: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 floor and its bfloat16 golden (rounding error of about 2**-9 relative)."""
    ref = torch.randn(tokens, width, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return ref, ref.to(torch.bfloat16)


def test_a_one_token_error_peaks_at_its_token_and_spreads_over_the_channels():
    ref, golden = layer_output()
    target = golden.clone()
    target[17] = (ref[17] * 1.05).to(torch.bfloat16)  # token 17 off by 5%
    picture = failure_picture(golden, target, ref)
    assert picture.worst_token == 17 and len(picture.tokens) == 24 and picture.token_block == 1
    others = [v for k, v in enumerate(picture.tokens) if k != 17]
    assert picture.tokens[17] > 20 * max(others) and max(others) <= 1.01  # the others round as the golden does
    # every channel carries the token's error: none stands out over the others as the token does (measured 4.8x)
    channels = sorted(picture.channels)
    assert channels[-1] < 6 * channels[len(channels) // 2]
    assert abs(sum(picture.golden_bins) - 1) < 1e-2 and abs(sum(picture.target_bins) - 1) < 1e-2
    assert len(picture.target_bins) == len(EDGES) + 1


def test_a_one_channel_error_peaks_at_its_channel():
    ref, golden = layer_output()
    target = golden.clone()
    target[:, 40] += 0.2
    picture = failure_picture(golden, target, ref)
    assert picture.worst_channel == 40 and picture.channels[40] > 20 * sorted(picture.channels)[-2]


def test_long_profiles_keep_each_blocks_largest_and_the_verdicts_tokens_only():
    ref, golden = layer_output(tokens=1000, width=8)
    target = golden.clone()
    target[999] += 1.0
    keep = torch.ones(1000, dtype=torch.bool)
    keep[3] = False  # left out by the verdict (a near-tie routing flip)
    picture = failure_picture(golden, target, ref, keep)
    assert picture.token_block == 4 and len(picture.tokens) == 250 <= POINTS
    assert picture.worst_token == 999  # the token's own index, not its place among the kept ones
    assert picture.tokens[-1] == max(picture.tokens)


def test_a_failing_outcome_carries_its_picture_into_the_properties_and_report_html(tmp_path):
    ref, golden = layer_output()
    target = golden.clone()
    target[5] = (ref[5] * 1.3).to(torch.bfloat16)
    settings = make_settings(verdict="noise")
    failing = judge(3, golden, target, settings, "bfloat16", floor=ref.to(torch.float32))
    passing = judge(3, golden, golden.clone(), settings, "bfloat16", floor=ref.to(torch.float32))
    assert not failing.passed and passing.passed and passing.picture is None
    props = dict(properties(failing))
    assert FailurePicture.from_json(props["failure_picture"]).worst_token == 5
    assert "failure_picture" not in dict(properties(passing))
    entry = ReportEntry("layerparity::test_layer_parity[layer_3]", "3", "fail", picture=props["failure_picture"])
    page = write_report_html(tmp_path, [entry]).read_text()
    assert page.count("<figure class='failure-picture'>") == 1
    assert all(f"<svg class='{name}'" in page for name in ("histogram", "per-token", "per-channel"))
    assert "largest per-token ratio" in page and "at token 5" in page
