"""The whole model's golden: the next-token logits of the prompt and of each decode step,
compact, with the noise envelope of perturbed runs of the teacher-forced procedure the target
gets."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..report.progress import Progress
from .reference_run import ReferenceRun

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from ..compare.logits import ModelEnvelope
    from ..model.steps import StepFn
    from ..options import Settings


def model_golden(
    model: PreTrainedModel, run: ReferenceRun, device: Any, settings: Settings, progress: Progress
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The whole model's golden: the next-token logits of the prompt and of each decode
    step, compact (top-k, log-sum-exp), with the envelope of K perturbed runs of the same
    teacher-forced procedure the target gets."""
    import torch

    from ..compare.logits import compact_logits
    from ..model.steps import hf_step

    logits = torch.cat([run.model_io["logits"].float(), *(t.float() for t in run.decode_logits)], dim=1)
    golden = compact_logits(logits, settings.logits_topk)
    golden["input_ids"] = run.model_io["input_ids"]
    decode_ids = run.model_io.get("decode_ids")
    if decode_ids is not None:
        golden["decode_ids"] = decode_ids
    metadata: dict[str, Any] = {"kind": "model_logits", "topk": settings.logits_topk}
    samples = model_envelope_samples(settings.envelope_samples) if not settings.no_precision_floor else 0
    if samples > 1:
        with progress.bar(samples, "layerparity: noise envelope of the whole model", "run") as bar:
            envelope = whole_model_envelope(hf_step(model), golden, device, samples, bar.update)
        metadata["envelope"] = envelope.as_metadata()
    return golden, metadata


def model_envelope_samples(samples: int) -> int:
    """Perturbed runs of the whole model's envelope for ``samples`` runs of each layer's: half
    as many and one more (7 of the default 12), at least 2; none where a layer has none.
    bench/bench_model_k.py, ten decoders in three dtypes, each test judged against the first
    K of 12 runs: 0 false alarms in 30 at K = 7 and 12; layer bugs caught 283 and 292 of 351
    at 32 tokens (286 and 291 at 128), bugs after the last layer 85 and 87 of 90 (88 and 89).
    A whole-model run costs as much as all the layers' runs of a prompt together (at 7, about
    a third of extraction's time): the layer bugs that 12 catch beyond 7 are the layer tests'
    to catch; a 1% final-norm scale in a 16-bit dtype is what 7 passes more often."""
    return max(2, samples // 2 + 1) if samples > 1 else samples


def whole_model_envelope(
    step: StepFn,
    golden: Mapping[str, torch.Tensor],
    device: Any,
    samples: int,
    done: Callable[[int], Any] = lambda n: None,
) -> ModelEnvelope:
    """The whole model's noise envelope: ``samples`` runs of the teacher-forced procedure the
    target gets (the golden's prompt and decode tokens through ``step``), each under perturbed
    arithmetic that also breaks exact ties among top-k candidates its own way (another
    backend's top-k takes other equal candidates, and what follows in later layers and the
    logits is legitimate). Runs go through the model together as the samples of one batch
    (``batching.samples_per_forward``: the model computes them apart; half as many after the
    device's memory runs out); ``done(n)`` after each batch of ``n`` runs."""
    from ..compare.logits import LogitsStats, ModelEnvelope, logits_stats
    from ..model.steps import teacher_forced
    from ..noise.batching import in_batches, samples_per_forward
    from ..noise.perturb import PerturbedArithmetic
    from ..noise.perturbed_runs import BASE_SEED

    ids, decode_ids = golden["input_ids"], golden.get("decode_ids")
    batch = ids.shape[0]
    tokens = batch * (ids.shape[-1] + (decode_ids.shape[-1] if decode_ids is not None else 0))
    group = samples_per_forward(samples, tokens, device if device is not None else "cpu")

    def runs(k: int, n: int) -> list[LogitsStats]:
        decoded = None if decode_ids is None else decode_ids.repeat(n, 1)
        with PerturbedArithmetic(BASE_SEED + k, samples=n, break_ties=True):
            perturbed = teacher_forced(step, ids.repeat(n, 1), decoded, device)
        return [logits_stats(golden, part) for part in perturbed.split(batch)]

    stats = []
    for made in in_batches(samples, group, runs):
        stats.extend(made)
        done(len(made))
    return ModelEnvelope.from_stats(stats)
