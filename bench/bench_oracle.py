"""What could any statistic of a layer's output tell? For each planted bug of
bench_verdicts.py, the best test there is against legitimate rounding: a matched filter that
knows the bug's own direction, beside the plugin's verdict.

    PJRT_DEVICE=CPU python bench/bench_oracle.py [--dtypes bfloat16] [--models llama,phi] [--runs 48]

Per model, dtype and bug (the middle layer's prompt test, torch-xla as in bench_verdicts.py):

* the bug's exact effect ``d``: the planted layer minus the correct one, both evaluated one
  precision wider than the golden (the precision floor's pass) on the golden's input;
* the legitimate spread along it: ``--runs`` perturbed runs of the correct layer (the noise
  envelope's Monte Carlo arithmetic), each projected on ``d / |d|`` after the floor is taken
  away;
* the planted port's projection (torch-xla), in standard deviations of that spread from its
  mean (``z``), against the one-sided limit at the plugin's false-alarm rate (0.001, the
  Student-t quantile of the runs); the correct port's z beside it (how well the runs model a
  real port along that direction).

* the port's error along each of the layer's branches (``floor.branch.*`` of the golden: its
  attention, its MLP or mixture of experts), in the same standard deviations, against the
  two-sided limit an envelope of 12 runs gives ``branch_bias`` with the false-alarm rate split
  over the three statistics and one per branch: what the branch statistic adds where the
  spread is known (the plugin's own verdict, beside it, has them with 12 runs).

A bug whose z stays under the limit cannot be told from rounding by any statistic of these
output elements in this dtype at that rate, even one that knows what the bug does: the
arithmetic's limit, not the verdict's. A bug over it that the plugin passes is one its
statistics (which do not know the direction) leave on the table. The sensitivity sweep of
bench_verdicts.py (the attention output projection scaled) gets the oracle's smallest caught
scale beside the plugin's.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_verdicts as bv
import torch
from scratch import work_folder

from pytest_layerparity.compare.envelope import t_quantile
from pytest_layerparity.compare.floor import FLOOR_KEY, branch_directions
from pytest_layerparity.noise.perturbed_runs import PerturbedRunner
from pytest_layerparity.selection import decode_key
from pytest_layerparity.store.golden import GoldenStore

RATE = 0.001
#: The plugin's default K, for the limit a branch statistic would get (:func:`branch_limit`).
ENVELOPE_K = 12
SWEEP = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05)


class Layer:
    """The middle layer of one golden store: its golden call, floor, and the legitimate
    spread of the perturbed runs (their outputs, kept for any direction)."""

    def __init__(
        self, model: Path, store: Path, extra: dict, dtype: str, index: int, runs: int, step: int | None = None
    ) -> None:
        self.model, self.store, self.extra, self.index, self.step = model, store, extra, index, step
        self.session = bv.session(model, store, extra, target="xla")
        self.entry = self.session.target.load_golden(index if step is None else decode_key(index, step))
        self.spec = self.entry.metadata["call"]
        self.floor = self.entry.tensors[FLOOR_KEY].double().flatten()
        runner = PerturbedRunner(self.session.model, getattr(torch, dtype), runs)
        self.runs = [
            r.output.double().flatten() - self.floor for r in runner.runs(index, self.spec, self.entry.tensors)
        ]
        self.port = self.output(None)

    def output(self, hook) -> torch.Tensor:
        """The port's output (torch-xla) minus the floor: the correct layer, or ``hook``'s."""
        s = self.session if hook is None else bv.session(self.model, self.store, self.extra, hook, target="xla")
        target = s.target
        return target.run(target.build(self.index), self.entry).output.detach().cpu().double().flatten() - self.floor

    def effect(self, plant) -> torch.Tensor | None:
        """The planted bug's exact effect on the output (the floor's arithmetic), or None where
        the bug does not apply to this layer or leaves its output as it is."""
        floor = self.session._floor
        layer = floor.load(self.index)
        broken = plant(layer, self.session.model.layer_config)
        if broken is None:
            return None
        out, _ = floor.evaluate(self.index, self.spec, self.entry.tensors, layer=broken)
        d = out.double().flatten() - self.floor
        return d if float(d.norm()) > 0 else None

    def z(self, direction: torch.Tensor, error: torch.Tensor) -> float:
        """How far ``error`` lies along ``direction`` from the runs, in their standard deviations."""
        along = [float(r @ direction) for r in self.runs]
        return (float(error @ direction) - statistics.mean(along)) / max(statistics.stdev(along), 1e-300)

    def branches(self) -> dict[str, torch.Tensor]:
        """The directions of the layer's branches the golden holds (``floor.branch.*``: its
        attention and its MLP or mixture of experts, in the floor's pass), as unit vectors."""
        flat = {name: v.double().flatten() for name, v in branch_directions(self.entry.tensors).items()}
        return {name: v / v.norm() for name, v in flat.items() if float(v.norm()) > 0}

    def plugin_catches(self, hook) -> bool:
        """Whether the plugin's verdict fails the planted port on this golden."""
        s = bv.session(self.model, self.store, self.extra, hook, target="xla")
        if self.step is None:
            return not s.parity_layer(self.index).passed
        return not s.target.parity_decode(self.index, [self.step])[0].passed

    def limit(self) -> float:
        k = len(self.runs)
        return t_quantile(1 - RATE, k - 1) * math.sqrt(1 + 1 / k)


def branch_limit(branches: int) -> float:
    """The two-sided limit a branch's bias would get in an envelope of ``ENVELOPE_K`` runs, the
    false-alarm rate split over the three statistics of today and one per branch."""
    return t_quantile(1 - RATE / (3 + branches) / 2, ENVELOPE_K - 1) * math.sqrt(1 + 1 / ENVELOPE_K)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--runs", type=int, default=48, help="perturbed runs for the spread along each direction")
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--models", default=",".join(bv.MODEL_GROUPS))
    parser.add_argument("--skip-sweep", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    work = work_folder("oracle-")
    rows, sweeps = [], []
    groups = tuple(args.models.split(","))
    for name, model, extra in bv.models(work, args.layers, groups):
        count = len(bv.session(model, work / "probe", extra).model.layer_list[1])
        mid = count // 2
        for dtype in args.dtypes.split(","):
            store = work / f"{name}-{dtype}".replace(" ", "_")
            bv.extract(model, store, extra, dtype, list(range(count)), 12, "cpu")
            stored = GoldenStore(store).read_manifest()["files"]
            goldens = [None, *([0] if decode_key(mid, 0) in stored else [])]
            for step in goldens:
                layer = Layer(model, store, extra, dtype, mid, args.runs, step)
                branches = layer.branches()
                blimit = branch_limit(len(branches))
                kinds = bv.BUGS if step is None else bv.DECODE_BUGS
                bugs = {bug: plant for bug, (plant, _) in kinds.items()}
                if not args.skip_sweep:
                    bugs.update({f"out_proj x{1 + eps:g}": bv.scaled_out_proj(1 + eps) for eps in SWEEP})
                where = "prompt" if step is None else f"decode step {step}"
                for bug, plant in bugs.items():
                    d = layer.effect(plant)
                    if d is None:
                        continue
                    direction = d / d.norm()
                    hook = bv.planted(plant, mid)
                    error = layer.output(hook)
                    z_bug = layer.z(direction, error)
                    z_port = layer.z(direction, layer.port)
                    along = {b: layer.z(v, error) for b, v in branches.items()}
                    branch = any(abs(z) > blimit for z in along.values())
                    plugin = layer.plugin_catches(hook)
                    row = (name, dtype, where, bug, z_bug, z_port, layer.limit(), plugin, branch)
                    (sweeps if bug.startswith("out_proj x") else rows).append(row)
                    read = " ".join(f"{b} {z:+.1f}" for b, z in along.items())
                    print(
                        f"{name:<20} {dtype:<9} {where:<13} {bug:<42} oracle z {z_bug:8.2f} (correct port "
                        f"{z_port:+6.2f}; limit {row[6]:.2f}) oracle {'caught' if z_bug > row[6] else 'cannot tell'}, "
                        f"plugin {'caught' if plugin else 'passed'}; branches {read} (limit {blimit:.2f})",
                        flush=True,
                    )
    report(rows, sweeps, args)


def report(rows: list, sweeps: list, args: argparse.Namespace) -> None:
    print(f"\nK = {args.runs} perturbed runs per layer for the spread; one-sided limit at {RATE} per test")
    print("\nplanted bugs: what the oracle (knowing the direction) and the plugin catch (the middle layer)")
    tally: dict = {}
    for _, dtype, where, _, z_bug, _, limit, plugin, branch in rows:
        cell = tally.setdefault((dtype, where), [0, 0, 0, 0, 0])
        oracle = z_bug > limit
        cell[0] += 1
        cell[1] += oracle
        cell[2] += plugin
        cell[3] += plugin or not oracle  # caught, or beyond the oracle
        cell[4] += plugin or branch or not oracle
    for (dtype, where), (n, oracle, plugin, within, with_branches) in sorted(tally.items()):
        print(
            f"  {dtype:<9} {where:<13} bugs {n}: the oracle catches {oracle}, the plugin {plugin}; caught or beyond "
            f"the oracle {100 * within / n:.0f}% (with branch statistics {100 * with_branches / n:.0f}%)"
        )
    for name, dtype, where, bug, z_bug, _, limit, plugin, branch in rows:
        if not plugin:
            verdict = "beyond the oracle" if z_bug <= limit else "the oracle catches it"
            verdict += "; a branch statistic catches it" if branch else ""
            print(
                f"  passed by the plugin: {name} {dtype} {where} {bug}: oracle z {z_bug:.2f} / {limit:.2f}: {verdict}"
            )
    ports = [abs(row[5]) for row in rows + sweeps]
    if ports:
        median, largest = statistics.median(ports), max(ports)
        print(f"  correct ports along the bugs' directions: |z| median {median:.2f}, largest {largest:.2f}")
    if sweeps:
        print("\nsensitivity (attention output projection scaled): the smallest scale each catches")
        by: dict = {}
        for name, dtype, where, bug, z_bug, _, limit, plugin, branch in sweeps:
            eps = float(bug.removeprefix("out_proj x")) - 1
            by.setdefault((dtype, name, where), []).append((eps, z_bug > limit, plugin, plugin or branch))
        for (dtype, name, where), found in sorted(by.items()):
            oracle, plugin, branches = smallest(found, 1), smallest(found, 2), smallest(found, 3)
            what = f"{dtype:<9} {name:<28} {where:<13}"
            print(f"  {what} oracle {oracle:>13}  plugin {plugin:>13}  with branches {branches}")


def smallest(found: list, which: int) -> str:
    """The smallest scale error caught with every larger one caught too."""
    found = sorted(found)
    caught = None
    for row in reversed(found):
        if not row[which]:
            break
        caught = row[0]
    return f"{100 * caught:.2f}%" if caught is not None else "none up to 5%"


if __name__ == "__main__":
    main()
