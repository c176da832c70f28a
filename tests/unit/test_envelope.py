"""Table tests of the noise envelope (compare.envelope), the verdict held against it
(compare.verdict, compare.judge) and the envelope measured from perturbed runs
(noise.perturbed_runs.envelope_from_runs). Hand-made numbers and small tensors; no model."""

from __future__ import annotations

import copy
import math
import weakref
from dataclasses import replace

import pytest
import torch
from test_judge import layer_like  # the same hand-made layer as the judge's table tests

from pytest_layerparity.compare.envelope import MIN_BIAS_SD, Envelope, t_quantile
from pytest_layerparity.compare.floor import FloorStats
from pytest_layerparity.compare.judge import judge
from pytest_layerparity.compare.metrics import Metrics
from pytest_layerparity.compare.verdict import evaluate
from pytest_layerparity.noise import perturbed_runs as reference_envelope
from pytest_layerparity.noise.batching import runs_apart
from pytest_layerparity.noise.perturb import PerturbedArithmetic
from pytest_layerparity.noise.perturbed_runs import (
    BASE_SEED,
    PerturbedRun,
    PerturbedRunner,
    envelope_from_runs,
)
from pytest_layerparity.options import make_settings
from pytest_layerparity.report.properties import properties
from pytest_layerparity.report.text import failure_text


@pytest.mark.parametrize(
    ("p", "df", "expected"),
    [(0.975, 1, 12.7062), (0.975, 3, 3.1824), (0.975, 15, 2.1314), (0.995, 11, 3.1058), (0.9995, 11, 4.4370)],
)
def test_t_quantile_matches_the_tables(p, df, expected):
    assert t_quantile(p, df) == pytest.approx(expected, abs=2e-3)


@pytest.mark.parametrize(("p", "df"), [(0.4, 5), (1.0, 5), (0.9, 0)])
def test_t_quantile_refuses_what_it_cannot_give(p, df):
    with pytest.raises(ValueError):
        t_quantile(p, df)


def envelope(ratios=(1.0, 1.1, 0.9, 1.05), tokens=(2.0, 2.2, 1.8, 2.1), biases=(1.0, -1.0, 2.0, 0.0), golden=0.5):
    return Envelope(tuple(ratios), tuple(tokens), tuple(biases), golden)


def test_the_ratio_limit_is_the_log_normal_prediction_limit():
    env = envelope()
    limits = env.limits(1e-3)
    logs = [math.log(v) for v in env.noise_ratio]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((v - mean) ** 2 for v in logs) / 3)
    q = t_quantile(1 - 1e-3 / 3, 3)
    assert limits.max_noise_ratio == pytest.approx(math.exp(mean + q * sd * math.sqrt(1 + 1 / 4)))
    assert limits.max_noise_ratio > max(env.noise_ratio)


def test_a_relative_envelopes_ratio_limit_stays_within_twice_what_its_runs_reached():
    """Runs mixing two alternatives (half near 1, half near 3) stretch a log-normal's spread
    far past every run; an envelope since rule 6 holds the limit at twice the largest run, and
    one whose fit stays below that keeps the fit. Older envelopes keep the fit alone."""
    from pytest_layerparity.compare.envelope import REACHED_FACTOR

    mixed = envelope(ratios=(1.0, 3.0, 1.1, 2.9, 0.9, 3.1), tokens=(2.0, 2.2, 1.8, 2.1, 2.0, 2.1), biases=(0,) * 6)
    fitted = mixed.limits(1e-3).max_noise_ratio
    assert fitted > 10
    relative = replace(mixed, relative=True).limits(1e-3)
    assert relative.max_noise_ratio == pytest.approx(REACHED_FACTOR * 3.1)
    assert relative.max_token_noise_ratio == pytest.approx(mixed.limits(1e-3).max_token_noise_ratio)  # below 4.4
    assert relative.max_token_noise_ratio < REACHED_FACTOR * 2.2


def test_a_port_a_control_can_be_held_beside_gets_tighter_ratio_limits_which_the_controls_reading_widens():
    """Where a same-device control can run (``control`` given), a ratio's limit is at most
    CONTROLLED_REACH times the runs' largest; where the control has run, CONTROL_FACTOR times
    its reading where that is more, never past the limit without a control. The keys and values
    a decode step appends stay widened to the limit without one; an envelope before rule 6
    (ratios not relative) keeps its fit whatever the control."""
    from pytest_layerparity.compare.envelope import CONTROL_FACTOR, CONTROLLED_REACH

    mixed = replace(
        envelope(ratios=(1.0, 3.0, 1.1, 2.9, 0.9, 3.1), tokens=(2.0, 2.2, 1.8, 2.1, 2.0, 2.1), biases=(0,) * 6),
        relative=True,
    )
    wide, tight = mixed.limits(1e-3), mixed.limits(1e-3, control={})
    assert wide.control is None and tight.control == {}
    assert tight.max_noise_ratio == pytest.approx(CONTROLLED_REACH * 3.1)
    assert tight.max_noise_ratio < wide.max_noise_ratio
    assert tight.max_token_noise_ratio == pytest.approx(min(wide.max_token_noise_ratio, CONTROLLED_REACH * 2.2))
    assert tight.wide_noise_ratio == pytest.approx(wide.max_noise_ratio)
    read = mixed.limits(1e-3, control={"noise_ratio": 3.5, "token_noise_ratio": 0.5})
    assert read.max_noise_ratio == pytest.approx(min(wide.max_noise_ratio, CONTROL_FACTOR * 3.5))
    assert tight.max_noise_ratio < read.max_noise_ratio <= wide.max_noise_ratio
    assert read.max_token_noise_ratio == pytest.approx(tight.max_token_noise_ratio)  # a control below: no wider
    assert mixed.limits(1e-3, control={"noise_ratio": 100.0}).max_noise_ratio == pytest.approx(wide.max_noise_ratio)
    assert "3.5" in read.describe() and "the model's own layer reads" in read.describe()
    assert "the model's own layer" not in wide.describe()
    older = replace(mixed, relative=False)
    assert older.limits(1e-3, control={}).max_noise_ratio == pytest.approx(older.limits(1e-3).max_noise_ratio)
    assert older.limits(1e-3, control={}).control is None


def test_the_bias_range_spans_zero_the_runs_mean_and_the_golden():
    limits = envelope(biases=(10.0, 10.5, 9.5, 10.0), golden=-3.0).limits(1e-3)
    half = t_quantile(1 - 1e-3 / 6, 3) * MIN_BIAS_SD * math.sqrt(1.25)  # the runs' spread is below one unit
    assert limits.bias_low == pytest.approx(-3.0 - half)
    assert limits.bias_high == pytest.approx(10.0 + half)


@pytest.mark.parametrize("rate", [1e-2, 1e-3, 1e-4])
def test_a_lower_false_alarm_rate_widens_every_limit(rate):
    tight, wide = envelope().limits(rate), envelope().limits(rate / 10)
    assert wide.max_noise_ratio > tight.max_noise_ratio
    assert wide.max_token_noise_ratio > tight.max_token_noise_ratio
    assert wide.bias_low < tight.bias_low and wide.bias_high > tight.bias_high


def test_the_envelope_round_trips_through_metadata():
    env = envelope()
    assert Envelope.from_metadata(env.as_metadata()) == env
    assert Envelope.from_metadata(None) is None and Envelope.from_metadata({}) is None


@pytest.mark.parametrize(
    "broken",
    [
        {"noise_ratio": [1.0]},
        {"token_noise_ratio": [1.0, 2.0, 3.0]},
        {"contribution_bias": [1.0, float("nan"), 0.0, 0.0]},
        {"golden_bias": "x"},
        {"noise_ratio": None},
    ],
)
def test_a_malformed_envelope_is_refused(broken):
    data = {**envelope().as_metadata(), **broken}
    with pytest.raises(ValueError, match="envelope"):
        Envelope.from_metadata(data)


# -- the verdict against the envelope -----------------------------------------------------------


def metrics() -> Metrics:
    return Metrics(0.0, 0.0, 100.0, 1.0, 1.0, 4, 0, 0, 0, 0, (0,), 1.0, 1.0, 0.0)


def stats(ratio=1.0, token=1.0, bias=0.0, golden=0.5) -> FloorStats:
    return FloorStats(ratio, token, 0, 1e-3, 1e-3, 1.0, 4, bias - golden, golden)


@pytest.mark.parametrize(
    ("floor", "fails"),
    [
        (stats(), []),
        (stats(ratio=1.3), []),
        (stats(ratio=50.0), ["noise_ratio"]),
        (stats(token=40.0), ["token_noise_ratio"]),
        (stats(bias=9.0), []),  # far beyond the fixed limit of 6 from the golden, inside this layer's envelope
        (stats(bias=600.0), ["contribution_bias"]),
        (stats(bias=-600.0), ["contribution_bias"]),
    ],
)
def test_each_statistic_against_its_envelope_limit(floor, fails):
    limits = envelope(biases=(4.0, -2.0, 6.0, 1.0)).limits(1e-3)
    checks = evaluate(metrics(), make_settings(), floor, "bfloat16", envelope=limits)
    assert [c.name for c in checks if not c.ok] == fails


def test_without_an_envelope_the_fixed_limits_hold():
    checks = evaluate(metrics(), make_settings(), stats(bias=9.0), "bfloat16")
    assert [c.name for c in checks if not c.ok] == ["contribution_bias"]


def test_an_explicit_limit_wins_over_the_envelope():
    limits = envelope().limits(1e-3)
    settings = make_settings(max_noise_ratio=1.2, max_contribution_z=1.0)
    checks = {c.name: c for c in evaluate(metrics(), settings, stats(ratio=1.3, bias=2.0), "bfloat16", limits)}
    assert not checks["noise_ratio"].ok and checks["noise_ratio"].limit == 1.2
    assert not checks["contribution_bias"].ok and (
        checks["contribution_bias"].low,
        checks["contribution_bias"].limit,
    ) == (
        -0.5,
        1.5,
    )
    assert checks["token_noise_ratio"].limit == pytest.approx(limits.max_token_noise_ratio)


def test_a_range_check_says_its_range():
    limits = envelope().limits(1e-3)
    (check,) = [c for c in evaluate(metrics(), make_settings(), stats(bias=99.0), "bfloat16", limits) if not c.ok]
    assert check.describe().startswith("contribution_bias                  99   in [")
    assert check.describe().endswith("FAIL")


# -- measured from perturbed runs, and the judge ------------------------------------------------


def other_roundings(ref, count, seed=100, noise=1e-3):
    gen = torch.Generator().manual_seed(seed)
    return [ref + noise * torch.randn(ref.shape, generator=gen, dtype=torch.float64) for _ in range(count)]


def test_runs_of_the_same_size_of_noise_make_an_envelope_near_one():
    x, ref, golden = layer_like()
    env = envelope_from_runs(golden, other_roundings(ref, 12), ref, x)
    assert env.samples == 12 and env.relative
    assert all(0.7 < r < 1.4 for r in env.noise_ratio)
    assert all(abs(b) < 5 for b in env.contribution_bias)
    assert env.golden_bias == pytest.approx(
        float((golden - ref).flatten() @ (ref - x).flatten())
        / float((ref - x).norm())
        * math.sqrt(golden.numel())
        / float((golden - ref).norm())
    )


def test_a_flipped_token_of_a_run_is_left_out_of_its_statistics():
    x, ref, golden = layer_like()
    runs = other_roundings(ref, 4)
    runs[0][3] += 5.0  # a routing flip on token 3: a large, legitimate difference
    with_flip = envelope_from_runs(golden, runs, ref, x)
    without = envelope_from_runs(golden, runs, ref, x, [{3}, set(), set(), set()])
    assert with_flip.noise_ratio[0] > 100
    assert without.noise_ratio[0] < 1.5


def test_a_run_that_leaves_out_every_token_is_skipped():
    # a decode step has one token: a run whose routing flipped on it says nothing about noise
    x, ref, golden = (t[:1] for t in layer_like())
    runs = other_roundings(ref, 4)
    env = envelope_from_runs(golden, runs, ref, x, [{0}, set(), {0}, set()])
    assert env is not None and env.samples == 2 and min(env.noise_ratio) > 0
    assert envelope_from_runs(golden, runs, ref, x, [{0}, {0}, {0}, set()]) is None


def test_the_envelope_takes_each_runs_statistics_as_it_ends(monkeypatch):
    """Extraction's envelope holds one run's output at a time (two while the next is made),
    whatever K: the same envelope as from all the outputs kept."""
    x, ref, golden = layer_like()
    outputs = other_roundings(ref, 6)
    made, alive = [], []

    def run(self, layer, spec, tensors, seed, hidden=None, on_device=False):
        out = outputs[seed - BASE_SEED].clone()
        made.append(weakref.ref(out))
        alive.append(sum(r() is not None for r in made))
        return PerturbedRun(out, {})

    monkeypatch.setattr(PerturbedRunner, "run", run)
    monkeypatch.setattr(
        reference_envelope, "samples_per_forward", lambda samples, tokens, device="cpu": 1
    )  # a long call's runs
    runner = PerturbedRunner(model=None, golden_dtype=torch.float64, samples=6)
    spec = {"args": [{"t": "x"}], "kwargs": {}, "output": {"t": "out"}}
    env = runner.envelope(0, spec, {"x": x}, golden, ref, x, layer=torch.nn.Identity())
    assert env.golden_flips == ()  # the rule applied (no router here: no token)
    assert replace(env, golden_flips=None) == envelope_from_runs(golden, outputs, ref, x)
    assert len(made) == 6 and max(alive) == 2
    kept = list(runner.runs(0, spec, {"x": x}, layer=torch.nn.Identity()))  # a chain keeps them all
    assert len(kept) == 6 and max(alive[6:]) == 6


def test_the_judge_holds_a_correct_target_inside_and_a_scaled_one_outside():
    x, ref, golden = layer_like()
    env = envelope_from_runs(golden, other_roundings(ref, 12), ref, x)
    target = other_roundings(ref, 1, seed=999)[0]
    settings = make_settings()
    good = judge(0, golden, target, settings, "float32", floor=ref, hidden_in=x, envelope=env)
    assert good.passed and good.envelope is not None and good.envelope.samples == 12
    bad = judge(0, golden, target + 1e-3 * (ref - x), settings, "float32", floor=ref, hidden_in=x, envelope=env)
    assert "contribution_bias" in [c.name for c in bad.checks if not c.ok]
    text = failure_text(bad, "on cpu", "next")
    assert "noise envelope from 12 perturbed runs of this layer" in text
    props = dict(properties(bad))
    assert props["contribution_bias"] == pytest.approx(bad.floor.contribution_bias)
    assert props["contribution_bias_high"] == pytest.approx(bad.envelope.bias_high)
    assert props["envelope_samples"] == 12


def test_tainted_tokens_leave_the_statistics_unless_routing_is_strict():
    x, ref, golden = layer_like()
    target = golden.clone()
    target[5] += 1.0  # diverged after an earlier near-tie flip in a chain
    loose = judge(0, golden, target, make_settings(), "float32", floor=ref, hidden_in=x, tainted=[5, 99])
    assert loose.passed and loose.tainted_tokens == [5]
    strict = judge(0, golden, target, make_settings(near_ties="strict"), "float32", floor=ref, hidden_in=x, tainted=[5])
    assert not strict.passed and strict.tainted_tokens == []


class _Block(torch.nn.Module):
    """A layer-like block: a projection, a norm (its variance), an activation, a projection;
    with ``mix``, each sample also reads the batch's mean (what no decoder layer does)."""

    def __init__(self, mix: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.norm, self.down = torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 16)
        self.mix = mix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.nn.functional.gelu(self.norm(self.up(x))))
        return h + x.mean(0, keepdim=True) if self.mix else h


CALL = {"args": [{"t": "x"}], "kwargs": {}, "output": {"t": "out"}}


def _runner(samples: int) -> PerturbedRunner:
    from types import SimpleNamespace

    return PerturbedRunner(model=SimpleNamespace(top_k=None), golden_dtype=torch.bfloat16, samples=samples)


def test_runs_of_a_short_call_go_through_the_layer_together_each_its_own_run(monkeypatch):
    layer = _Block().bfloat16()
    x = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    calls = []
    monkeypatch.setattr(PerturbedRunner, "run", lambda *a, **k: calls.append(1))  # one at a time: not taken
    runs = list(_runner(6).runs(0, CALL, {"x": x}, layer=layer))
    plain = layer(x).float()
    assert len(runs) == 6 and not calls
    outputs = [r.output.float() for r in runs]
    assert all(o.shape == plain.shape for o in outputs)
    assert len({o.flatten().tolist().__repr__() for o in outputs}) == 6  # six different legitimate runs
    for o in outputs:  # each within a few of bf16's roundings of the plain output
        assert (o - plain).abs().max() < 0.1 * plain.abs().max()


class _SmallDevice(_Block):
    """The block on a device whose memory holds at most ``room`` runs of the call at once."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room, self.batches = room, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.batches.append(x.shape[0])
        if x.shape[0] > self.room:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(x)


def test_on_an_accelerator_every_run_goes_together_or_as_many_as_its_memory_holds(monkeypatch):
    from pytest_layerparity.noise.batching import samples_per_forward

    assert samples_per_forward(12, 4096, "cuda:0") == 12  # each op's launches paid once for all
    assert samples_per_forward(12, 4096, "cpu") == 1 and samples_per_forward(12, 32, "cpu") == 12
    x = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    monkeypatch.setattr(reference_envelope, "samples_per_forward", lambda samples, tokens, device="cpu": samples)
    small = _SmallDevice(room=3).bfloat16()
    runs = [r.output for r in _runner(12).runs(0, CALL, {"x": x}, layer=small)]
    # the check that runs go apart (2), then 12 and 6 out of memory, then 3 at a time
    assert small.batches == [2, 1, 1, 12, 6, 3, 3, 3, 3]
    monkeypatch.setattr(reference_envelope, "samples_per_forward", lambda samples, tokens, device="cpu": 3)
    again = [r.output for r in _runner(12).runs(0, CALL, {"x": x}, layer=_SmallDevice(room=3).bfloat16())]
    assert all(torch.equal(a, b) for a, b in zip(runs, again, strict=True))  # the same runs as 3 at a time
    other = _SmallDevice(room=3).bfloat16()
    other.forward = lambda x: (_ for _ in ()).throw(RuntimeError("shapes cannot be multiplied"))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):  # any other error is the layer's own
        list(_runner(4).runs(0, CALL, {"x": x}, layer=other))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_envelope_keeps_its_runs_there_and_its_statistics_equal_the_cpus(monkeypatch):
    import copy
    from types import SimpleNamespace

    from pytest_layerparity.compare import floor

    layer = _Block().bfloat16().cuda()
    x = torch.randn(1, 64, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    golden = layer(x.cuda()).cpu()
    reference = copy.deepcopy(layer).float()(x.float().cuda()).cpu()
    runner = PerturbedRunner(model=SimpleNamespace(top_k=None), golden_dtype=torch.bfloat16, samples=4, device="cuda")
    assert {r.output.device.type for r in runner.runs(0, CALL, {"x": x}, layer=layer, on_device=True)} == {"cuda"}
    assert {r.output.device.type for r in runner.runs(0, CALL, {"x": x}, layer=layer)} == {"cpu"}
    there = runner.envelope(0, CALL, {"x": x}, golden, reference, x, layer=layer).as_metadata()
    monkeypatch.setattr(floor, "statistics_device", lambda *devices: torch.device("cpu"))
    here = runner.envelope(0, CALL, {"x": x}, golden, reference, x, layer=layer).as_metadata()
    assert set(there) == set(here)
    for name, value in here.items():
        assert there[name] == pytest.approx(value, rel=1e-9), name


def test_a_layer_that_mixes_the_samples_of_a_batch_runs_them_one_at_a_time():
    x = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(1))
    assert runs_apart(_Block(), CALL, {"x": x}, "cpu")
    assert not runs_apart(_Block(mix=True), CALL, {"x": x}, "cpu")
    runs = list(_runner(4).runs(0, CALL, {"x": x.bfloat16()}, layer=_Block(mix=True).bfloat16()))
    assert len(runs) == 4 and all(r.output.shape == (1, 8, 16) for r in runs)


def test_each_stacked_run_draws_its_own_variance_algorithm():
    """One pass (E[x^2] - E[x]^2) or two, drawn per run: on rows whose mean is large against
    their spread the two differ, and the runs of one batch take both."""
    rows = torch.randn(1, 64, generator=torch.Generator().manual_seed(2)) + 3000.0
    x = rows.repeat(8, 1)  # eight runs of the same row
    exact = torch.var(rows.double()).item()

    def one_pass(var: torch.Tensor) -> set[bool]:  # its cancellation error is far above the two-pass rounding
        return {abs(v - exact) > 1e-3 * exact for v in var.tolist()}

    with PerturbedArithmetic(5, samples=8):
        assert one_pass(torch.var(x, dim=-1)) == {True, False}
    with PerturbedArithmetic(5, samples=1):  # one run: one draw for the op
        assert len(one_pass(torch.var(x, dim=-1))) == 1


class _CachedBlock(torch.nn.Module):
    """A decoder-like block that appends its keys and values to a transformers cache."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.k, self.v, self.o = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x, past_key_values=None):
        k, v = self.k(x).unsqueeze(1), self.v(x).unsqueeze(1)
        k, v = past_key_values.update(k, v, 0)
        scores = torch.softmax(x.unsqueeze(1) @ k.transpose(-1, -2) / 4.0, dim=-1)
        return x + self.o((scores @ v).squeeze(1))


@pytest.mark.parametrize("together", [True, False])
def test_a_decode_steps_envelope_holds_each_runs_appended_keys_and_values(monkeypatch, together):
    from transformers.cache_utils import DynamicCache

    from pytest_layerparity.capture.calls import capture_calls

    if not together:
        monkeypatch.setattr(reference_envelope, "samples_per_forward", lambda samples, tokens, device="cpu": 1)
    layer = _CachedBlock().bfloat16()
    cache = DynamicCache()
    past = torch.randn(1, 1, 5, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    cache.update(past, past * 0.5, 0)
    records = {}
    x = torch.randn(1, 1, 16, generator=torch.Generator().manual_seed(4)).bfloat16()
    with torch.no_grad(), capture_calls({0: layer}, records.__setitem__):
        layer(x, past_key_values=cache)
    record = records[0]
    tensors = dict(record.tensors)
    # the floor: the same call one precision wider
    wide = copy.deepcopy(layer).double()
    args, kwargs = reference_envelope.decode_call(record.spec, {k: v.double() for k, v in tensors.items()})
    with torch.no_grad():
        floor = wide(*args, **kwargs)
    new = kwargs["past_key_values"].layers[0]
    tensors["floor.cache.new_keys"], tensors["floor.cache.new_values"] = new.keys[..., -1:, :], new.values[..., -1:, :]
    golden = tensors["output"]
    env = _runner(6).envelope(0, record.spec, tensors, golden, floor, tensors["args.0"], layer=layer)
    assert env is not None and env.samples == 6
    assert len(env.new_keys_noise_ratio) == 6 and len(env.new_values_noise_ratio) == 6
    assert all(0 < r < 20 for r in (*env.new_keys_noise_ratio, *env.new_values_noise_ratio))
    assert len(set(env.new_keys_noise_ratio)) > 1  # each run's own


def test_the_golden_flips_round_trip_and_a_malformed_list_is_refused():
    """An envelope records the tokens its runs left out for the golden's own routing flips
    (none: an empty list); one made before the rule records nothing and reads back as None."""
    made = replace(envelope(), golden_flips=(3, 7))
    assert Envelope.from_metadata(made.as_metadata()) == made
    assert Envelope.from_metadata(replace(made, golden_flips=()).as_metadata()).golden_flips == ()
    old = envelope().as_metadata()
    assert "golden_flips" not in old and Envelope.from_metadata(old).golden_flips is None
    for broken in ("3", [1.5], [True], {"a": 1}):
        with pytest.raises(ValueError, match="golden_flips"):
            Envelope.from_metadata({**old, "golden_flips": broken})


def test_relative_ratios_round_trip_and_an_older_envelope_reads_as_absolute():
    """Runs measured with each element's error weighed by its size say so (a target is then
    measured alike); an envelope made before reads back as absolute, its nested family too."""
    made = replace(envelope(), relative=True, float32_sums=replace(envelope(), relative=True))
    assert Envelope.from_metadata(made.as_metadata()) == made
    old = envelope().as_metadata()
    assert "relative" not in old and not Envelope.from_metadata(old).relative
    with pytest.raises(ValueError, match="relative"):
        Envelope.from_metadata({**old, "relative": "yes"})


def test_a_decode_steps_runs_go_together_their_past_counted_at_a_share():
    """A one-token step over 512 past tokens counts 1 + 512 / PAST_SHARE against
    BATCHED_TOKENS: all 12 runs in one forward, where a 512-token prompt's go one at a time."""
    from transformers.cache_utils import DynamicCache

    from pytest_layerparity.capture.calls import capture_calls
    from pytest_layerparity.noise.batching import PAST_SHARE, call_tokens, samples_per_forward

    layer, cache, records = _CachedBlock().bfloat16(), DynamicCache(), {}
    past = torch.randn(1, 1, 512, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    cache.update(past, past, 0)
    with torch.no_grad(), capture_calls({0: layer}, records.__setitem__):
        layer(torch.randn(1, 1, 16).bfloat16(), past_key_values=cache)
    tokens = call_tokens(records[0].spec, records[0].tensors)
    assert tokens == 1 + 512 // PAST_SHARE and samples_per_forward(12, tokens) == 12
    assert samples_per_forward(12, 512) == 1
