"""Chained runs and bisection: layers fed the target's own outputs, as in a real forward
pass, so that drift accumulates; and the search for the first layer whose chained output
leaves tolerance."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from ..capture.router_hooks import capture_routing
from ..compare.floor import FLOOR_KEY, branch_directions
from ..compare.judge import LayerOutcome, judge_golden
from ..selection import LayerRange
from ..store.callspec import (
    cache_argument,
    decode_call,
    first_tensor,
    hidden_input_name,
    primary_output_name,
    replace_hidden_input,
)
from ..store.golden import GoldenEntry

if TYPE_CHECKING:
    import torch

    from .runner import TargetRun, TargetSide

#: The fewest perturbed chains without an upstream routing flip that make an envelope of
#: their own for a target without one (below it, all chains do).
MIN_CLEAN_CHAINS = 4


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


def _local(
    target: TargetSide,
    index: int,
    entry: GoldenEntry,
    run: TargetRun,
    target_in: torch.Tensor,
    reference: torch.nn.Module,
    tainted: set[int],
) -> LayerOutcome:
    """Layer ``index`` of a chain judged on its own: the target's output against the
    reference layer fed the same input the target layer was fed (the target's own upstream
    output), in the golden's dtype and in the floor's, with the layer's isolated noise
    envelope. Upstream drift cancels out, so a layer whose own error is small beside the
    drift accumulated before it is still seen."""
    import torch

    spec = entry.metadata["call"]
    given = target_in.detach().to("cpu")
    floor, floor_routing = target.floor.evaluate(index, spec, entry.tensors, given, layer=reference)
    call = replace_hidden_input(spec, dict(entry.tensors), given.to(target.floor.golden_dtype))
    args, kwargs = decode_call(spec, call, cache_name=cache_argument(reference))
    routing: dict[str, torch.Tensor] = {}
    with torch.no_grad(), capture_routing(reference, target.model.top_k, routing):
        golden = first_tensor(reference(*args, **kwargs)).detach().to("cpu", copy=True)
    output = primary_output_name(spec)
    local = {**entry.tensors, output: golden, FLOOR_KEY: floor, **routing, **floor_routing}
    return judge_golden(
        index,
        local,
        output,
        run.output,
        run.routing,
        target.settings,
        target.golden_dtype_name,
        hidden_in=given.to(target.floor.dtype),
        envelope=target.envelope_of(entry),
        tainted=sorted(tainted),
    )


def chain(target: TargetSide, layers: LayerRange | list[int]) -> list[LayerOutcome]:
    """Run the layers on the target from the golden input of the first, feeding each
    layer's own output forward (a chained run, as in a real forward pass), and judge
    every layer's output against its golden.

    The precision floor of a chain is the same chain evaluated in higher precision on
    the CPU, and its noise envelope is K chains of the reference layers in the golden's
    dtype under Monte Carlo arithmetic: accumulated drift is judged against what
    legitimate arithmetic accumulates over the same layers. A token whose routing
    flipped on a near tie (within the golden's rounding of the router's scores, or the
    perturbed chains' drift of them) leaves the statistics of the later layers too (in
    the target and in each perturbed chain alike): what follows a legitimate flip is
    legitimate."""
    from ..compare.routing_agreement import fold_drift
    from ..noise.perturbed_runs import envelope_from_runs, flipped_tokens

    indices = layers.layers() if isinstance(layers, LayerRange) else list(layers)
    outcomes = []
    hidden = ref_hidden = None
    samples = target.perturbed.samples if target.perturbed is not None and target.perturbed.enabled else 0
    sample_hidden: list[torch.Tensor | None] = [None] * samples
    sample_flipped: list[set[int]] = [set() for _ in range(samples)]
    tainted: set[int] = set()
    bar = target.progress.bar(len(indices), f"layerparity: chain {indices[0]}-{indices[-1]}")
    for index in indices:
        bar.update(1)
        entry = target.load_golden(index)
        spec = entry.metadata["call"]
        if ref_hidden is None:
            ref_hidden = entry.tensors[hidden_input_name(spec)].to(target.floor.dtype)
        ref_in = ref_hidden
        target_in = hidden
        run = target.run(target.build(index), entry, hidden)
        hidden = run.output
        envelope = local = None
        if FLOOR_KEY in entry.tensors:
            reference = target.floor.load(index)  # once for the floor chain, the local check, the envelope's runs
            ref_hidden, _ = target.floor.evaluate(index, spec, entry.tensors, ref_hidden, reference, extras=False)
            if target_in is not None:
                local = _local(target, index, entry, run, target_in, reference, tainted)
            entry = replace(entry, tensors={**entry.tensors, FLOOR_KEY: ref_hidden})
            if samples:
                assert target.perturbed is not None
                # The target's drift so far is clean (no near-tie flip upstream) or not: it is
                # held to the perturbed chains in the same state (all of them when too few are).
                clean = [k for k in range(samples) if not sample_flipped[k]]
                on_cpu = reference if target.perturbed.device == "cpu" else None
                drift: dict[str, torch.Tensor] = {}
                for k, perturbed in enumerate(
                    target.perturbed.runs(index, spec, entry.tensors, sample_hidden, layer=on_cpu)
                ):
                    sample_hidden[k] = perturbed.output
                    sample_flipped[k] |= flipped_tokens(entry.tensors, perturbed.routing)
                    fold_drift(entry.tensors, perturbed.routing, drift)
                chosen = clean if not tainted and len(clean) >= MIN_CLEAN_CHAINS else list(range(samples))
                envelope = envelope_from_runs(
                    entry.tensors[primary_output_name(spec)],
                    [sample_hidden[k] for k in chosen],
                    ref_hidden,
                    ref_in,
                    [sample_flipped[k] for k in chosen],
                    branch_directions(entry.tensors),
                )
                entry = replace(entry, tensors={**entry.tensors, **drift})  # the routers' near ties, in a chain
            del reference
        outcome = target.judge(index, entry, run, hidden_in=ref_in, envelope=envelope, tainted=tainted)
        if local is not None:  # the layer's own computation, on the input the target gave it
            outcome.checks.extend(replace(c, name=f"local_{c.name}") for c in local.checks)
        outcomes.append(outcome)
        tainted |= {
            t for r in outcome.routing for t in r.near_tie_tokens
        }  # the judge drops it under --near-ties strict
    bar.close()
    return outcomes
