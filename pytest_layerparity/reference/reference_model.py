"""The reference model of one session: where it is placed and how it loads, the extraction
it makes (the manifest header; a store that holds another's refused), and, where it overflows
in the extraction's dtype, the other dtypes measured. :class:`.extract.ReferenceSide` runs it."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..errors import ModelError
from ..model.build import build_skeleton, find_layer_list, layer_count_from_config
from ..model.devices import resolve_golden_device
from ..model.fingerprint import WEIGHTS_FIELD
from ..model.memory import give_back_memory
from ..model.source import ModelSource
from ..noise.perturbed_runs import ENVELOPE_RULE
from ..noise.wide_pass import FloorEvaluator
from ..options import RunMode
from ..report.progress import SILENT, Progress
from ..selection import layer_key
from ..store.differences import describe_differences
from ..store.finite import all_finite_by_sum
from ..store.golden import (
    MODEL_IO_KEY,
    UNCALLED_KEY,
    GoldenError,
    GoldenStore,
)
from ..store.identity import EXTRACTION_KEYS, recorded_weights
from .audit import dtype_audit, mixed_dtype_failure
from .inputs import input_description, stored_input_shape
from .overflow import Measured, Overflow, OverflowWatch, StopForward, output_overflow, overflow_text
from .placement import choose_device_map, input_device, load_whole_model, placement_summary
from .reference_run import ReferenceRun
from .spill import mapped_empty

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from ..model.streaming import Unit
    from ..options import Settings


class ReferenceModel:
    """The reference model of one session, before and beside its forward pass (the extraction's
    :class:`.extract.ReferenceSide`). ``extract_command(layers, dtype=None)`` is the fix errors
    suggest."""

    def __init__(
        self,
        settings: Settings,
        model: ModelSource,
        store: GoldenStore,
        dtype_name: str,
        floor: FloorEvaluator,
        extract_command: Callable[..., str],
        progress: Progress = SILENT,
    ) -> None:
        self.settings = settings
        self.model = model
        self.store = store
        self.dtype_name = dtype_name
        self.floor = floor
        self.extract_command = extract_command
        self.progress = progress
        self.placement: dict[str, Any] | None = None  # accelerate's device map of the whole model
        self.audit: dict[str, list[tuple[str, str, tuple[int, ...]]]] = {}  # streamed unit -> odd tensors
        self._run: ReferenceRun | None = None
        self._keep_in_fp32: list[str] | None = None  # modules the model keeps in float32 on purpose
        self._header_written = False
        self._model_io_checked = False
        self._overflow: str | None = None  # the error of a reference that overflows in this dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name)

    @cached_property
    def golden_device(self) -> str:
        return resolve_golden_device(self.settings.golden_device)

    @cached_property
    def device_map(self) -> str:
        """'stream', or an accelerate device map for the whole model (sized for the stored
        input where this run re-runs it)."""
        settings = self.settings
        if settings.mode == RunMode.VERIFY:
            settings = stored_input_shape(settings, self.store.read_manifest())
        return choose_device_map(settings, self.model, self.dtype_name, self.golden_device)

    def _load(self, streaming: bool) -> PreTrainedModel:
        if streaming:
            return build_skeleton(self.model.hf_config, self.torch_dtype, self.model.trust_remote_code)
        model, self.placement = load_whole_model(self.model, self.settings, self.torch_dtype, self.device_map)
        return model

    def placement_summary(self) -> str:
        return placement_summary(self.placement, self.device_map, self.golden_device)

    def _own_failure(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        keep = [*(self._keep_in_fp32 or ()), *(getattr(model, "_keep_in_fp32_modules_strict", None) or ())]
        return mixed_dtype_failure(model, self.torch_dtype, keep)

    def _audit_unit(self, unit: Unit, module: torch.nn.Module) -> None:
        """The dtype audit of one streamed unit: refuse a layer that would materialise in
        float32 under a 16-bit request (the seeds' 1 TB bug), naming the tensors."""
        report = dtype_audit(module, self.torch_dtype, keep=self._keep_in_fp32)
        self.audit[unit.path] = report.odd
        if report.fatal:
            raise ModelError(f"{unit.path}: {report.message}")

    @property
    def layer_path(self) -> str:
        """The decoder layers' list in the model (as the run found it, once it has run)."""
        return self._run.layer_path if self._run is not None else self.model.layer_list[0]

    def _overflow_text(self, found: Overflow, ids: torch.Tensor, decode_ids: torch.Tensor | None) -> str:
        """The error of a reference that overflows in this dtype at ``found``, with the other
        supported dtypes' forwards to the same place measured (each loads the model again:
        the failure's cost alone). A decode step's place is reached teacher-forced: the prompt
        and the tokens decoded up to that step, in one forward."""
        import torch

        from ..options import DTYPES

        if found.step is not None and decode_ids is not None:
            ids = torch.cat([ids, decode_ids[:, : found.step + 1]], dim=-1)
        others = [name for name in DTYPES if name != self.dtype_name]
        measured: dict[str, Measured] = {}
        with self.progress.bar(len(others), f"layerparity: overflows in {self.dtype_name}; measuring", "dtype") as bar:
            for name in others:
                measured[name] = self._measure(name, ids, found.layer)
                bar.update(1)
        layers = None if self.settings.layers == "all" else self.settings.layers
        return overflow_text(self.dtype_name, found, measured, lambda name: self.extract_command(layers, dtype=name))

    def _measure(self, dtype_name: str, ids: torch.Tensor, stop: int | None) -> Measured:
        """The reference's forward in ``dtype_name`` on ``ids``, placed as an extraction in it
        would be, through layer ``stop`` (None: the whole forward and its logits)."""
        import torch

        other = type(self)(self.settings, self.model, self.store, dtype_name, self.floor, self.extract_command)
        streaming = other.device_map == "stream"
        model = other._load(streaming)
        layer_path, _ = find_layer_list(model, layer_count_from_config(self.model.config_json), self.model.layer_module)
        layer_list = model.get_submodule(layer_path)
        watch = OverflowWatch()
        output = None
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            if streaming:
                from ..model.streaming import streamed

                empty = functools.partial(mapped_empty, self.store.root)
                device = other.golden_device
                stack.enter_context(
                    streamed(model, self.model.checkpoint, layer_path, other.torch_dtype, device, empty=empty)
                )
            else:
                device = input_device(model)
            stack.enter_context(watch.watching(layer_list, stop))
            with contextlib.suppress(StopForward):
                output = model(input_ids=ids.to(device), use_cache=False)
        first, largest = watch.first(), watch.largest(stop) if stop is not None else 0.0
        if output is not None and first is None:
            has_logits = getattr(output, "logits", None) is not None
            logits = (output.logits if has_logits else output.last_hidden_state).detach()
            first = output_overflow(logits, None, output_name(has_logits), all_finite_by_sum)
            largest = float(logits.abs().amax()) if first is None else first.largest
        del model, output
        give_back_memory()
        return Measured(first, largest)

    def header(self) -> dict[str, Any]:
        """The manifest header of this extraction."""
        import torch
        import transformers

        identity = self.model.identity()
        identity.update(
            {"path": str(self.model.model_dir), "name": self.model.model_dir.name, "layer_module": self.layer_path}
        )
        return {
            "created_by": f"pytest-layerparity {__version__}",
            "model": identity,
            "dtype": self.dtype_name,
            "reference_device": self.golden_device.split(":")[0],
            "inputs": input_description(self.settings),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "envelope": {
                "rule": ENVELOPE_RULE,
                "runs": 0 if self.settings.no_precision_floor else self.settings.envelope_samples,
            },
            # of every layer (not only those selected), known once the reference has run
            **({UNCALLED_KEY: {str(i): c for i, c in self._run.uncalled.items()}} if self._run is not None else {}),
        }

    def check_store_takes_extraction(self, layers: list[int] = ()) -> None:
        """Refuse (before any test) to extract into a store that holds goldens of another
        extraction (model, inputs, dtype, or the weights of ``layers``), naming the difference
        and the fix."""
        manifest = self.store.read_manifest()
        if not manifest or not manifest.get("files"):
            return
        differences = describe_differences(manifest, self.header(), EXTRACTION_KEYS)
        for index in layers:
            recorded = recorded_weights(manifest, layer_key(index), WEIGHTS_FIELD)
            found = recorded and self.model.weights_fingerprint(index, self.torch_dtype, self.layer_path)
            if recorded != found:
                source = (manifest.get("model") or {}).get("path")
                differences.append(
                    f"layer {index}'s weights: store has sha256 {recorded[:12]} (from {source}), "
                    f"this run has {(found or 'none')[:12]} (in {self.model.model_dir})"
                )
        if differences:
            raise GoldenError(
                f"{self.store.manifest_path}: this store holds goldens of another extraction "
                f"({'; '.join(differences)}); extract into another --golden-dir, or add --force-regen to replace "
                "the store (the old one is kept until the new one is complete)"
            )

    def stored_input_ids(self) -> torch.Tensor:
        entry = self.store.load(MODEL_IO_KEY, missing_hint=f"extract first: {self.extract_command(None)}")
        return entry.tensors["input_ids"]


def output_name(has_logits: bool) -> str:
    return "the logits" if has_logits else "the model's output (its last hidden state)"
