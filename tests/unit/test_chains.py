"""Bisection to the first diverging layer (replay.chains.bisect), against a fake chain."""

from __future__ import annotations

import math

import pytest

from pytest_layerparity.replay.chains import bisect


@pytest.mark.parametrize("n", range(1, 18))
def test_bisect_finds_the_first_bad_layer_wherever_it_is(n):
    layers = list(range(10, 10 + n))
    for bad in [None, *layers]:
        calls = []

        def passes(prefix, bad=bad, calls=calls):
            calls.append(prefix)
            assert prefix == layers[: len(prefix)] and prefix  # always a prefix from the first layer
            return bad is None or prefix[-1] < bad

        found, probes = bisect(layers, passes)
        assert found == bad
        assert [(prefix[-1], bad is None or prefix[-1] < bad) for prefix in calls] == probes
        assert len(probes) <= math.ceil(math.log2(n)) + 1
        if bad is not None:
            assert (bad, False) in probes and (bad == layers[0] or (bad - 1, True) in probes or probes[0][0] == bad)
