"""Chained runs and bisection: layers fed the target's own outputs, as in a real forward
pass, so that drift accumulates; and the search for the first layer whose chained output
leaves tolerance."""

from __future__ import annotations

from collections.abc import Callable


def bisect(layers: list[int], passes: Callable[[list[int]], bool]) -> tuple[int | None, list[tuple[int, bool]]]:
    """The first layer whose chained output leaves tolerance, with O(log n) calls of
    ``passes(prefix)`` (does the chain over ``prefix``, from the golden input of its first
    layer, pass at every layer?). Returns (first bad layer or None, [(end layer of each
    probe, passed)]). Assumes that once a chain fails, every longer chain fails too."""
    probes: list[tuple[int, bool]] = []

    def probe(end: int) -> bool:
        ok = passes(layers[: end + 1])
        probes.append((layers[end], ok))
        return ok

    if probe(len(layers) - 1):
        return None, probes
    lo, hi = 0, len(layers) - 1  # the chain fails at hi; find the first failing end
    while lo < hi:
        mid = (lo + hi) // 2
        if probe(mid):
            lo = mid + 1
        else:
            hi = mid
    return layers[lo], probes
