"""The noise envelope, measured: a layer run K times in the golden's dtype under Monte Carlo
arithmetic (``noise.perturb``), each run's statistics against the golden and the
precision floor taken as one legitimate sample (``compare.envelope``). Extraction stores
the envelope with each golden; chained runs measure one along the chain.

One layer is loaded at a time (in the golden's dtype, on the device the reference ran on),
so the envelope keeps extraction's memory bound."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ..capture.router_hooks import capture_routing
from ..compare.envelope import FLOAT32_SUMS, Envelope
from ..compare.floor import FloorStats, branch_directions, floor_stats, statistics_device, token_mask
from ..compare.routing_agreement import agreement, golden_floor_flips, router_names
from ..model.build import eager_experts_skeleton
from ..model.checkpoint import load_layer
from ..model.memory import give_back_memory
from ..model.source import ModelSource
from ..report.progress import SILENT, Progress
from ..store.callspec import cache_argument, decode_call, first_tensor, hidden_input_name, replace_hidden_input
from ..store.kv_updates import appended_kv
from .batching import call_tokens, in_batches, runs_apart, samples_per_forward, stacked_call
from .perturb import SIXTEEN_BIT_ACCUMULATION, PerturbedArithmetic
from .tokens import in_token_blocks

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

#: Seeds of the perturbed runs: run k of any layer uses BASE_SEED + k.
BASE_SEED = 1000
#: What the perturbed runs compute, as a number raised with each change of it (an alternative
#: drawn, an error scaled otherwise): a store's manifest records it, and an extraction into a
#: store made under another refuses to mix their envelopes (the whole model's is kept where it
#: verifies). 2: half the runs' fused float32 attention leaning toward zero (.tensor_cores);
#: 3: that lean growing with the keys a query sees; 4: a 16-bit result rounded stochastically
#: from halfway to the reference's result (``perturb.SIXTEEN_BIT_PULL``); 5: half the runs' float32
#: matmuls lowered as XLA's CPU backend does (``lowerings.SEQUENTIAL_SUMS``); 6: the ratios on errors
#: weighed element by element (``compare.floor.element_sizes``); 7: half the runs' 16-bit fused
#: attention computed as eager attention (``algorithms.eager_attention``); 8: that eager
#: attention rounded to nearest, not perturbed; 9: in XLA's lowering (rule 5), a one-row float32
#: matmul without a bias of fewer than 4096 products summed as the reference sums it (XLA sums
#: it in blocks), a one-query attention's scores and a one-row batched matmul summed in order;
#: 10: those one-row matmuls computed as that sum computes them, a fused multiply-add at a time
#: (``sums.fused_sequential_sum``), not a draw of their error's size.
ENVELOPE_RULE = 10


@dataclass
class PerturbedRun:
    """One perturbed run of a layer: its output (CPU), its routers' decisions, and in a
    decode step the keys and values it appended to the cache."""

    output: torch.Tensor
    routing: dict[str, torch.Tensor]
    appended: tuple[torch.Tensor, torch.Tensor] | None = None


def flipped_tokens(golden: Mapping[str, torch.Tensor], routing: Mapping[str, torch.Tensor]) -> set[int]:
    """Tokens whose experts in ``routing`` differ from the golden's, for any router."""
    out: set[int] = set()
    for name in router_names(dict(golden)):
        found = agreement(name, dict(golden), dict(routing), 0.0)
        if found is not None:
            out.update(found.flipped_tokens)
    return out


def run_stats(
    golden: torch.Tensor,
    out: torch.Tensor,
    reference: torch.Tensor,
    hidden_in: torch.Tensor | None,
    drop: Collection[int] = (),
    branches: Mapping[str, torch.Tensor] | None = None,
) -> FloorStats | None:
    """The statistics of one perturbed output ``out`` against ``golden`` and its floor
    ``reference`` (and along the ``branches``' outputs; the ratios relative, as every envelope's
    since rule 6: ``compare.floor.element_sizes``), tokens ``drop`` left out (those whose
    routing flipped); None when that leaves out every token (a decode step's one token
    flipped): the run says nothing."""
    rows = golden.numel() // golden.shape[-1] if golden.dim() > 1 else 1
    drop = drop if golden.dim() > 1 else ()
    if len(set(drop) & set(range(rows))) == rows:
        return None
    return floor_stats(golden, out, reference, hidden_in, token_mask(rows, drop), branches, relative=True)


def envelope_from_stats(
    golden: torch.Tensor,
    reference: torch.Tensor,
    hidden_in: torch.Tensor | None,
    stats: Iterable[FloorStats | None],
    branches: Mapping[str, torch.Tensor] | None = None,
    golden_flips: Sequence[int] | None = None,
) -> Envelope | None:
    """The envelope of the perturbed runs whose statistics (:func:`run_stats`) are
    ``stats``, taken one at a time (a run's output need not outlive its statistics); None
    when fewer than two runs kept a token. ``golden_flips``: the tokens every run left out
    (where the golden's experts differ from its floor's), recorded on the envelope; None: no
    such rule (a chain's runs)."""
    kept = [s for s in stats if s is not None]
    if len(kept) < 2:
        return None
    rows = golden.numel() // golden.shape[-1] if golden.dim() > 1 else 1
    keep = token_mask(rows, golden_flips) if golden_flips else None
    ref_only = floor_stats(golden, golden, reference, hidden_in, keep, directions=branches, relative=True)
    # a branch every run measured (a run that kept no token of it would lack it)
    names = [n for n in ref_only.golden_branch_z if all(n in s.branch_z for s in kept)]
    return Envelope(
        noise_ratio=tuple(s.noise_ratio for s in kept),
        token_noise_ratio=tuple(s.token_noise_ratio for s in kept),
        contribution_bias=tuple(s.contribution_bias or 0.0 for s in kept),
        golden_bias=ref_only.golden_contribution_z or 0.0,
        branch_bias={n: tuple(s.branch_bias[n] for s in kept) for n in names},
        golden_branch_bias={n: ref_only.golden_branch_z[n] for n in names},
        golden_flips=tuple(golden_flips) if golden_flips is not None else None,
        relative=True,
    )


def envelope_from_runs(
    golden: torch.Tensor,
    runs: Sequence[torch.Tensor],
    reference: torch.Tensor,
    hidden_in: torch.Tensor | None,
    left_out: Sequence[set[int]] | None = None,
    branches: Mapping[str, torch.Tensor] | None = None,
) -> Envelope | None:
    """The envelope of the perturbed outputs ``runs`` against ``golden`` and its floor
    ``reference`` (and along the ``branches``' outputs); ``left_out[k]``: tokens run k leaves
    out of its statistics (those whose routing flipped: legitimate arithmetic flips near
    ties, and what follows is legitimate). None when fewer than two runs are left."""
    return envelope_from_stats(
        golden,
        reference,
        hidden_in,
        (
            run_stats(golden, out, reference, hidden_in, left_out[k] if left_out else (), branches)
            for k, out in enumerate(runs)
        ),
        branches,
    )


def appended_ratios(
    tensors: Mapping[str, torch.Tensor], appended: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[float, float] | None:
    """A decode-step run's noise ratio of the keys and of the values it appended, against the
    golden's (``cache.new_*``) and their floor (``floor.cache.new_*``); None where the golden
    holds none of them or the run appended something else."""
    from ..compare.metrics import noise_ratio

    if appended is None or "floor.cache.new_keys" not in tensors or "cache.new_keys" not in tensors:
        return None
    ratios = []
    for part, run in zip(("keys", "values"), appended, strict=True):
        golden = tensors[f"cache.new_{part}"]
        if tuple(run.shape) != tuple(golden.shape):
            return None
        ratio = noise_ratio(golden, run, tensors[f"floor.cache.new_{part}"])
        if not math.isfinite(ratio):
            return None
        ratios.append(ratio)
    return ratios[0], ratios[1]


class PerturbedRunner:
    """Runs the layers of one model in the golden's dtype under Monte Carlo arithmetic, K
    times each, on ``device``; ``sixteen_bit_sums``: float16 matmuls may sum in float16 (the
    chains' runs of a target whose matmuls sum in float32 do not)."""

    def __init__(
        self,
        model: ModelSource,
        golden_dtype: torch.dtype,
        samples: int,
        device: str = "cpu",
        progress: Progress = SILENT,
        sixteen_bit_sums: bool = True,
    ) -> None:
        self.model = model
        self.dtype = golden_dtype
        self.samples = samples
        self.device = device
        self.progress = progress
        self.sixteen_bit_sums = sixteen_bit_sums

    @cached_property
    def skeleton(self) -> PreTrainedModel:
        return eager_experts_skeleton(self.model.hf_config, self.dtype, self.model.trust_remote_code)

    @property
    def enabled(self) -> bool:
        """Whether there are runs to make (an envelope needs two or more)."""
        return self.samples > 1

    def layer(self, index: int) -> torch.nn.Module:
        """Layer ``index`` as the reference runs it, in the golden's dtype, on the device."""
        return (
            load_layer(self.skeleton, self.model.checkpoint, self.model.layer_list[0], index, self.dtype)
            .eval()
            .to(self.device)
        )

    def run(
        self,
        layer: torch.nn.Module,
        spec: Mapping[str, Any],
        tensors: Mapping[str, torch.Tensor],
        seed: int,
        hidden: torch.Tensor | None = None,
        on_device: bool = False,
    ) -> PerturbedRun:
        """One perturbed run of ``layer`` on the call ``spec``/``tensors`` (hidden states
        replaced by ``hidden`` when given); its output on the CPU, or left where it was
        computed (``on_device``)."""
        call = dict(tensors) if hidden is None else replace_hidden_input(spec, dict(tensors), hidden)
        out, routing, appended = self._forward(layer, spec, call, seed, 1)
        return PerturbedRun(out.to(out.device if on_device else "cpu", copy=True), routing, appended)

    def _forward(
        self, layer: torch.nn.Module, spec: Mapping[str, Any], call: dict[str, torch.Tensor], seed: int, samples: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]:
        """``layer`` on ``call`` under Monte Carlo arithmetic (``samples`` runs stacked along
        the first dim): its output (detached, where it was computed), the routers' records and
        the keys and values it appended."""
        import torch

        args, kwargs = decode_call(spec, call, self.device, cache_argument(layer))
        routing: dict[str, torch.Tensor] = {}
        with (
            torch.no_grad(),
            capture_routing(layer, self.model.top_k, routing),
            in_token_blocks(layer),
            PerturbedArithmetic(seed, samples=samples, sixteen_bit_sums=self.sixteen_bit_sums),
        ):
            out = first_tensor(layer(*args, **kwargs)).detach()
        return out, routing, appended_kv(args, kwargs, spec, call)

    def run_together(
        self,
        layer: torch.nn.Module,
        spec: Mapping[str, Any],
        tensors: Mapping[str, torch.Tensor],
        seed: int,
        hidden: Sequence[torch.Tensor | None],
        on_device: bool = False,
    ) -> list[PerturbedRun] | None:
        """``len(hidden)`` perturbed runs of ``layer`` as the samples of one batch (run j on
        ``hidden[j]``, None: the golden's input), each its own legitimate run (every draw is
        per element; a variance's algorithm is drawn per run); None where the layer's
        outputs cannot be split back into runs (its first dimension is not the batch). Outputs
        as :meth:`run`'s."""
        import torch

        n = len(hidden)
        call = stacked_call(spec, tensors, n)
        name = hidden_input_name(spec)
        call[name] = torch.cat([tensors[name] if h is None else h for h in hidden])
        out, routing, appended = self._forward(layer, spec, call, seed, n)
        out = out if on_device else out.to("cpu")
        if out.shape[0] != call[name].shape[0] or any(t.shape[0] % n for t in routing.values()):
            return None
        if appended is not None and any(t.shape[0] != out.shape[0] for t in appended):
            return None
        outs = out.chunk(n)
        parts = {key: t.chunk(n) for key, t in routing.items()}
        kv = [t.chunk(n) for t in appended] if appended is not None else None
        return [
            PerturbedRun(
                outs[j].clone(),
                {key: p[j] for key, p in parts.items()},
                (kv[0][j].clone(), kv[1][j].clone()) if kv is not None else None,
            )
            for j in range(n)
        ]

    def runs(
        self,
        index: int,
        spec: Mapping[str, Any],
        tensors: Mapping[str, torch.Tensor],
        hidden: Sequence[torch.Tensor | None] | None = None,
        layer: torch.nn.Module | None = None,
        on_device: bool = False,
    ) -> Iterator[PerturbedRun]:
        """The K perturbed runs of layer ``index`` on its golden call (run k on ``hidden[k]``
        when given, for chains), in order (a chain keeps them: each run's output goes on),
        with the layer loaded once and given back after (or ``layer``, already loaded on the
        device, kept). Runs of a short call go through the layer together, as one batch of up
        to ``batching.BATCHED_TOKENS`` tokens on the CPU, all of them on an accelerator (half
        as many after the device's memory runs out: :func:`.batching.fewer_fit`) with
        :meth:`run_together`, where the layer computes the samples of a batch apart
        (:func:`runs_apart`, checked on the call); else one at a time. Outputs as :meth:`run`'s."""
        owned = layer is None
        if layer is None:
            layer = self.layer(index)
        given = list(hidden) if hidden is not None else [None] * self.samples
        group = samples_per_forward(self.samples, call_tokens(spec, tensors), self.device)
        if group > 1 and not runs_apart(layer, spec, tensors, self.device):
            group = 1

        def batch(k: int, n: int) -> list[PerturbedRun]:
            seed = BASE_SEED + k
            together = self.run_together(layer, spec, tensors, seed, given[k : k + n], on_device) if n > 1 else None
            return together or [self.run(layer, spec, tensors, seed, given[k], on_device)]

        family = "" if self.sixteen_bit_sums or self.dtype not in SIXTEEN_BIT_ACCUMULATION else " (float32 sums)"
        with self.progress.bar(self.samples, f"layerparity: noise envelope of layer {index}{family}", "run") as bar:
            for together in in_batches(self.samples, group, batch):
                give_back_memory()  # the runs' freed temporaries: the next ones' heap starts empty
                for run in together:
                    bar.update(1)
                    yield run
                del together
        if owned:
            del layer
            give_back_memory()

    def envelope(
        self,
        index: int,
        spec: Mapping[str, Any],
        tensors: Mapping[str, torch.Tensor],
        golden: torch.Tensor,
        reference: torch.Tensor,
        hidden_in: torch.Tensor | None,
        layer: torch.nn.Module | None = None,
    ) -> Envelope | None:
        """The envelope of layer ``index`` on its golden call (what extraction stores; None
        when fewer than two runs kept a token); a float16 layer's with its second family, the
        same runs with every float16 matmul summed in float32 (``Envelope.float32_sums``).
        Each run's output is dropped once its statistics are taken: the memory does not grow
        with K. On a CUDA device the runs' outputs stay there and the statistics are taken
        there (``floor.statistics_device``), the golden, its floor and its directions moved
        there once."""
        owned = layer is None
        if layer is None:
            layer = self.layer(index)
        branches = branch_directions(tensors)
        fixed = golden_floor_flips(dict(tensors))  # left out of every run, as the target's test leaves them out
        on_device = statistics_device(self.device).type != "cpu"
        if on_device:  # the statistics where the runs are
            golden, reference = golden.to(self.device), reference.to(self.device)
            hidden_in = hidden_in.to(self.device) if hidden_in is not None else None
            branches = {name: v.to(self.device) for name, v in branches.items()}
        own = self.sixteen_bit_sums
        families: list[Envelope | None] = []
        try:
            for sums in (own, False) if own and self.dtype in SIXTEEN_BIT_ACCUMULATION else (own,):
                self.sixteen_bit_sums = sums
                stats, appended = [], []
                for run in self.runs(index, spec, tensors, layer=layer, on_device=on_device):
                    drop = flipped_tokens(tensors, run.routing) | set(fixed)
                    stats.append(run_stats(golden, run.output, reference, hidden_in, drop, branches))
                    appended.append(appended_ratios(tensors, run.appended))
                envelope = envelope_from_stats(golden, reference, hidden_in, stats, branches, fixed)
                kept = [ratios for ratios, s in zip(appended, stats, strict=True) if s is not None]
                if envelope is not None and kept and None not in kept:
                    keys, values = zip(*kept, strict=True)
                    envelope = replace(envelope, new_keys_noise_ratio=keys, new_values_noise_ratio=values)
                families.append(envelope)
        finally:
            self.sixteen_bit_sums = own
        if owned:
            del layer
            give_back_memory()
        envelope, wide = families[0], families[1] if len(families) > 1 else None
        if envelope is None or wide is None:
            return envelope
        return replace(envelope, float32_sums=replace(wide, method=FLOAT32_SUMS))
