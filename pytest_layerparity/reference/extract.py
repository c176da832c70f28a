"""The reference side: run the HuggingFace model once on the golden input, capture every
selected layer's whole call and output, and write them (with the precision floor) as
goldens; or re-run it and check that the stored goldens reproduce.

Long because :class:`ReferenceSide` is one run's state, shared by the extraction and the verification.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..capture.calls import called_layers, capture_calls
from ..capture.router_hooks import capture_routing
from ..compare.floor import FLOOR_KEY
from ..compare.judge import LayerOutcome, judge_golden
from ..errors import ModelError
from ..model.build import build_skeleton, find_layer_list, layer_count_from_config
from ..model.devices import resolve_golden_device
from ..model.fingerprint import WEIGHTS_FIELD
from ..model.memory import give_back_memory
from ..model.source import ModelSource
from ..noise.perturbed_runs import ENVELOPE_RULE, PerturbedRunner
from ..noise.wide_pass import FloorEvaluator
from ..options import RunMode
from ..report.progress import SILENT, Progress
from ..selection import decode_key, layer_key
from ..store import promptkv
from ..store.callspec import (
    CallRecord,
    UnstorableCache,
    cache_argument,
    decode_call,
    hidden_input_name,
    primary_output_name,
    returned_cache,
)
from ..store.differences import describe_differences
from ..store.golden import (
    MODEL_IO_KEY,
    MODEL_LOGITS_KEY,
    UNCALLED_KEY,
    GoldenEntry,
    GoldenError,
    GoldenStore,
    all_finite_by_sum,
)
from ..store.identity import EXTRACTION_KEYS, recorded_weights
from .audit import dtype_audit, mixed_dtype_failure
from .inputs import input_description, make_input_ids, stored_input_shape
from .overflow import Measured, Overflow, OverflowWatch, ReferenceOverflow, StopForward, output_overflow, overflow_text
from .placement import choose_device_map, input_device, load_whole_model, placement_summary
from .prompt_cache import filled, filling, prompt_cache, unknown_with_cache, with_or_without
from .spill import SpilledCalls, SpilledKV, mapped_empty

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from ..compare.logits import ModelEnvelope
    from ..model.steps import StepFn
    from ..model.streaming import Unit
    from ..options import Settings


class UncalledLayer(Exception):
    """A selected layer the model's forward did not call on the golden input: it has no call
    to record (the message says which layer, and why it gets no golden)."""


def uncalled_text(index: int, layer_class: str, model_class: str) -> str:
    return (
        f"layer {index} ({layer_class}) is not called by {model_class}'s forward on the golden input (the model "
        "skips it for this input, as a text-only forward skips a cross-attention layer): there is no call to "
        "record, so it gets no golden and no parity test; the other layers are tested as usual"
    )


@dataclass
class ReferenceRun:
    """What one forward pass of the reference model captured."""

    calls: SpilledCalls  # layer -> its call (on disk until its golden is written)
    decode_calls: SpilledCalls  # (layer, step) -> its call
    model_io: dict[str, torch.Tensor] = field(default_factory=dict)
    layer_path: str = ""
    decode_logits: list[torch.Tensor] = field(default_factory=list)  # each decode step's logits (CPU)
    model_golden: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None  # whole-model golden and metadata
    spilled_io: SpilledCalls | None = None  # model_io's tensors kept on disk (streaming: the prompt's logits)
    uncalled: dict[int, str] = field(default_factory=dict)  # layer -> its class: of all, those the prompt skipped
    model_class: str = ""
    decode_skipped: str = ""  # why a model without an LM head has no decode steps
    prompt_kv: str | None = None  # why the prompt goldens hold no keys and values their call wrote (None: they do)

    def io_tensors(self) -> dict[str, torch.Tensor]:
        """``model_io``'s tensors, with those kept on disk read back."""
        io = dict(self.model_io)
        if self.spilled_io is not None and MODEL_IO_KEY in self.spilled_io:
            io.update(self.spilled_io[MODEL_IO_KEY].tensors)
        return io

    def drop_io(self) -> None:
        """Forget ``model_io`` (written), on disk too."""
        self.model_io.clear()
        self.decode_logits.clear()
        if self.spilled_io is not None:
            self.spilled_io.clear()


class ReferenceSide:
    """The reference model of one session: its placement, its one forward pass (cached), and
    the goldens written from it. ``extract_command(layers, dtype=None)`` is the fix errors suggest."""

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

    @cached_property
    def perturbed(self) -> PerturbedRunner:
        """The perturbed runs that make each golden's noise envelope (on the reference's device)."""
        return PerturbedRunner(
            self.model, self.torch_dtype, self.settings.envelope_samples, self.golden_device, self.progress
        )

    def run(
        self,
        layers: list[int],
        input_ids: torch.Tensor | None = None,
        stored: Callable[[int], GoldenEntry] | None = None,
    ) -> ReferenceRun:
        """Run the whole reference model once, capturing ``layers``' calls (cached). With
        ``stored`` (a layer's stored golden), each of ``layers`` is called with its stored
        call instead of what the layers before it computed here, the prompt alone (no decode
        steps, no whole-model golden): each layer's output from the inputs its golden was made
        from, on this placement."""
        if self._run is not None:
            return self._run
        if self._overflow is not None:
            raise ReferenceOverflow(self._overflow)
        import torch

        streaming = self.device_map == "stream"
        model = self._load(streaming)
        layer_path, _ = find_layer_list(model, layer_count_from_config(self.model.config_json), self.model.layer_module)
        layer_list = model.get_submodule(layer_path)
        self._keep_in_fp32 = getattr(model, "_keep_in_fp32_modules", None)
        run = ReferenceRun(
            SpilledCalls(self.store.root),
            SpilledCalls(self.store.root),
            layer_path=layer_path,
            model_class=type(model).__name__,
        )
        ids = (
            make_input_ids(self.settings, self.model.model_dir, self.model.vocab_size)
            if input_ids is None
            else input_ids
        )
        device = self.golden_device if streaming else input_device(model)
        embeddings = model.get_input_embeddings()

        def record_embeddings(module: Any, args: Any, output: torch.Tensor) -> None:  # the prompt's (the first call)
            if "embeddings" not in run.model_io:
                run.model_io["embeddings"] = output.detach().to("cpu", copy=True)

        handle = embeddings.register_forward_hook(record_embeddings)
        routing: dict[int, dict[str, torch.Tensor]] = {i: {} for i in layers}
        steps = self.settings.decode_steps
        watch = OverflowWatch() if stored is None else None  # (a verification re-runs finite goldens)
        found: Overflow | None = None
        bar = self.progress.bar(len(layer_list) * (1 + (steps + 1 if steps else 0)), "layerparity: reference forward")
        ticks = [layer.register_forward_hook(lambda *_: bar.update(1)) for layer in layer_list]
        try:
            with contextlib.ExitStack() as stack:
                stack.callback(bar.close)
                stack.enter_context(torch.no_grad())
                if streaming:
                    from ..model.streaming import streamed

                    stack.enter_context(
                        streamed(
                            model,
                            self.model.checkpoint,
                            layer_path,
                            self.torch_dtype,
                            self.golden_device,
                            on_unit=self._audit_unit,
                            # the prompt's logits (seq x vocab) in a file-backed map: on disk as written
                            empty=functools.partial(mapped_empty, self.store.root),
                        )
                    )
                called: set[int] = set()
                if stored is not None:
                    stack.enter_context(self._stored_calls(layer_list, layers, stored, device))
                # the decode steps' cache filled by this forward, where it can be (.prompt_cache)
                name = cache_argument(layer_list[0], self.model.cache_argument) if len(layer_list) else None
                cache = prompt_cache(model, layer_list, name) if steps and stored is None and not streaming else None

                def capturing(given: Any, model: Any = model) -> Any:  # (deleted after: run() lets go of the model)
                    with (
                        self._capturing(layer_list, layers, run.calls.__setitem__, routing),
                        called_layers(layer_list, called),
                        watch.watching(layer_list) if watch is not None else contextlib.nullcontext(),
                        self._own_failure(model),
                        filling(layer_list, given, name),  # after the capture's hooks: out of its sight
                    ):
                        return model(input_ids=ids.to(device), use_cache=False)

                output, cache = with_or_without(capturing, cache)
                del capturing
                run.prompt_kv = _prompt_kv_unknown(model, layer_list, name, steps)
                run.uncalled = {i: type(m).__name__ for i, m in enumerate(layer_list) if i not in called}
                has_logits = getattr(output, "logits", None) is not None
                # the prompt's logits, held once: the tensor itself where it is on the CPU already;
                # streaming puts them on disk (seq x vocab: more than a layer's activations)
                logits = (output.logits if has_logits else output.last_hidden_state).detach().to("cpu")
                del output
                if watch is not None:
                    found = watch.first() or output_overflow(logits, None, _output_name(has_logits), all_finite_by_sum)
                full = has_logits and filled(cache, len(layer_list), ids.shape[-1])
                prompt = (cache, logits[:, -1]) if full else None
                if streaming:
                    run.spilled_io = SpilledCalls(self.store.root)
                    run.spilled_io[MODEL_IO_KEY] = CallRecord(tensors={"logits": logits})
                else:
                    run.model_io["logits"] = logits
                del logits
                if steps and watch is not None and found is None:
                    kv = SpilledKV(self.store.root) if streaming else None  # flat in depth
                    if kv is not None:
                        stack.callback(kv.close)
                    self._decode(model, layer_list, layers, ids.to(device), run, kv, prompt, watch)
                    found = watch.first() or _steps_overflow(run.decode_logits)
        finally:
            handle.remove()
            for tick in ticks:
                tick.remove()
        if found is not None:
            decode_ids = run.model_io.get("decode_ids")
            del model, cache, prompt
            run.calls.clear()  # (their spilled files go)
            run.decode_calls.clear()
            run.drop_io()
            give_back_memory()  # before the other dtypes' models load
            self._overflow = self._overflow_text(found, ids.cpu(), decode_ids)
            raise ReferenceOverflow(self._overflow)
        for i, tensors in routing.items():
            run.calls.add(i, tensors)
        run.model_io["input_ids"] = ids.cpu()
        if not streaming and self.settings.logits_topk and has_logits and stored is None:
            run.model_golden = self._model_golden(model, run, device)
        self._run = run
        del model
        give_back_memory()  # the streamed units' and the forward's freed memory, before the layers load
        return run

    @contextlib.contextmanager
    def _stored_calls(
        self, layer_list: Any, layers: list[int], stored: Callable[[int], GoldenEntry], device: Any
    ) -> Iterator[None]:
        """While the block runs, each of ``layers`` is called with its stored call (read as
        it is reached), its inputs on ``device`` (a placement's hooks move them on)."""
        cache_name = cache_argument(layer_list[layers[0]], self.model.cache_argument) if layers else None

        def hook(index: int) -> Callable[..., tuple[tuple, dict]]:
            def replace(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
                entry = stored(index)
                spec = entry.metadata["call"]  # the call as the capture recorded it: no prompt cache
                new_args, new_kwargs = decode_call(spec, entry.tensors, device, cache_name, prompt_cache=False)
                return tuple(new_args), new_kwargs

            return replace

        handles = [layer_list[i].register_forward_pre_hook(hook(i), with_kwargs=True, prepend=True) for i in layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def _capturing(
        self,
        layer_list: Any,
        layers: list[int],
        sink: Callable[[int, CallRecord], None],
        routing: dict[int, dict[str, torch.Tensor]],
    ) -> Iterator[None]:
        """While the block runs, each selected layer's call goes to ``sink`` and its routers'
        choices into ``routing``."""
        with contextlib.ExitStack() as capture:
            capture.enter_context(capture_calls({i: layer_list[i] for i in layers}, sink))
            for i in layers:
                capture.enter_context(capture_routing(layer_list[i], self.model.top_k, routing[i]))
            yield

    def _decode(
        self,
        model: PreTrainedModel,
        layer_list: Any,
        layers: list[int],
        ids: torch.Tensor,
        run: ReferenceRun,
        kv: SpilledKV | None = None,
        prompt: tuple[Any, torch.Tensor] | None = None,
        watch: OverflowWatch | None = None,
    ) -> None:
        """The decode steps after the prompt: the prompt once more with the KV cache (unless
        ``prompt`` gives the cache the prompt's forward filled and its last logits), then
        ``--decode-steps`` greedy tokens, one forward each, recording every selected layer's
        call (its past keys and values included) per step. With ``kv``, the cache is held a
        layer at a time (the rest on disk). Each step feeds the model what its generate would
        (the new token, or the whole sequence to a model that slices the cached part off).
        ``watch`` notes each step's layer outputs."""
        import torch

        from ..model.steps import step_input_ids

        def spilling() -> contextlib.AbstractContextManager[None]:
            return kv.hooks(layer_list) if kv is not None else contextlib.nullcontext()

        if prompt is not None:
            cache, last = prompt
        else:
            # the prompt again, for its cache: of its logits only the last position's are used
            parameters = inspect.signature(model.forward).parameters
            last_only = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
            with spilling():
                output = model(input_ids=ids, use_cache=True, **last_only)
            cache = returned_cache(output)
            if getattr(output, "logits", None) is None:  # an encoder: no next token to decode, said in the summary
                run.decode_skipped = (
                    f"none: {type(model).__name__} has no LM head (no logits, no next token to decode); its goldens "
                    "are the prompt's"
                )
                return
            if cache is None:
                raise ModelError(
                    f"--decode-steps {self.settings.decode_steps}: {type(model).__name__} returned no KV cache "
                    "for the prompt with use_cache=True, so it has no decode steps to record; extract with "
                    "--decode-steps 0"
                )
            last = output.logits[:, -1]
        name = cache_argument(model.forward, "past_key_values")
        tokens = []
        sequence = ids
        for step in range(self.settings.decode_steps):
            token = last.argmax(-1, keepdim=True)
            tokens.append(token.cpu())
            sequence = torch.cat([sequence, token.to(sequence.device)], dim=-1)
            fed = step_input_ids(model, sequence, cache, name)  # what generate feeds the model
            routing: dict[int, dict[str, torch.Tensor]] = {i: {} for i in layers}

            def sink(i: int, record: CallRecord, step: int = step) -> None:
                run.decode_calls[(i, step)] = record

            if watch is not None:
                watch.step = step
            try:
                with (
                    self._capturing(layer_list, layers, sink, routing),
                    watch.watching(layer_list) if watch is not None else contextlib.nullcontext(),
                    spilling(),  # spilled after the capture and the watch saw it
                ):
                    output = model(input_ids=fed, **{name: cache}, use_cache=True)
            except UnstorableCache as exc:  # an entry the config did not announce
                raise ModelError(f"--decode-steps {self.settings.decode_steps}: {exc}") from None
            last = output.logits[:, -1]
            run.decode_logits.append(output.logits[:, -1:].detach().to("cpu", copy=True))  # the new token's
            for i, tensors in routing.items():
                run.decode_calls.add((i, step), tensors)
        run.model_io["decode_ids"] = torch.cat(tokens, dim=-1)

    def _model_golden(
        self, model: PreTrainedModel, run: ReferenceRun, device: Any
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The whole model's golden: the next-token logits of the prompt and of each decode
        step, compact (top-k, log-sum-exp), with the envelope of K perturbed runs of the same
        teacher-forced procedure the target gets."""
        import torch

        from ..compare.logits import compact_logits
        from ..model.steps import hf_step

        logits = torch.cat([run.model_io["logits"].float(), *(t.float() for t in run.decode_logits)], dim=1)
        golden = compact_logits(logits, self.settings.logits_topk)
        golden["input_ids"] = run.model_io["input_ids"]
        decode_ids = run.model_io.get("decode_ids")
        if decode_ids is not None:
            golden["decode_ids"] = decode_ids
        metadata: dict[str, Any] = {"kind": "model_logits", "topk": self.settings.logits_topk}
        samples = model_envelope_samples(self.settings.envelope_samples) if not self.settings.no_precision_floor else 0
        if samples > 1:
            with self.progress.bar(samples, "layerparity: noise envelope of the whole model", "run") as bar:
                envelope = whole_model_envelope(hf_step(model), golden, device, samples, bar.update)
            metadata["envelope"] = envelope.as_metadata()
        return golden, metadata

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

        other = ReferenceSide(self.settings, self.model, self.store, dtype_name, self.floor, self.extract_command)
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
            first = output_overflow(logits, None, _output_name(has_logits), all_finite_by_sum)
            largest = float(logits.abs().amax()) if first is None else first.largest
        del model, output
        give_back_memory()
        return Measured(first, largest)

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

    def extract_layer(self, index: int, layers: list[int]) -> dict[str, Any]:
        """Write the golden of layer ``index`` (running the reference once for ``layers``)."""
        run = self.run(layers)
        if not self._header_written:
            self.store.begin(self.header(), compare_keys=EXTRACTION_KEYS)
            self._header_written = True
        if not self._model_io_checked:
            if not self.store.verifies(MODEL_IO_KEY):  # absent or damaged: (re)write it; NaN logits are left out
                io = run.io_tensors()
                if run.model_golden is not None:  # the whole model's logits are kept compact there
                    io = {k: v for k, v in io.items() if k != "logits"}
                self.store.write(MODEL_IO_KEY, io, {"kind": "model_io"}, omit_nonfinite=True)
                del io
            if run.model_golden is not None and not self.store.verifies(MODEL_LOGITS_KEY):
                self.store.write(MODEL_LOGITS_KEY, *run.model_golden)
            self._model_io_checked = True
            run.drop_io()  # written: the prompt's logits (seq x vocab) need not stay for every layer
            give_back_memory()  # with the serialisation's buffers
        if index in run.uncalled:
            for key in [k for k in run.decode_calls if k[0] == index]:  # (a layer only a decode step ran)
                del run.decode_calls[key]
            raise UncalledLayer(uncalled_text(index, run.uncalled[index], run.model_class))
        # One load of the layer for the floor and the envelope of all its goldens (the prompt
        # and each decode step); the envelope's runs use it where they run on the CPU too.
        layer = None if self.settings.no_precision_floor else self.floor.load(index)
        try:
            steps = sorted(step for (i, step) in run.decode_calls if i == index)
            prompt = run.calls[index]
            first = run.decode_calls[(index, steps[0])] if steps else None
            skipped = run.decode_skipped.removeprefix("none: ")
            promptkv.attach(prompt, first, f"no decode steps: {skipped}" if skipped else run.prompt_kv)
            del first
            info = self._write_golden(index, layer_key(index), prompt, layer=layer)
            del prompt
            for step in steps:
                self._write_golden(index, decode_key(index, step), run.decode_calls[(index, step)], step, layer)
                del run.decode_calls[(index, step)]
        finally:
            del layer
            give_back_memory()
        del run.calls[index]  # written: its spilled copy goes
        info["decode_steps"] = len(steps)
        if run.decode_skipped:
            info["decode_note"] = run.decode_skipped
        return info

    def _write_golden(
        self,
        index: int,
        key: str,
        record: CallRecord,
        step: int | None = None,
        layer: torch.nn.Module | None = None,
    ) -> dict[str, Any]:
        """Write one golden of layer ``index`` (the prompt's call, or decode step ``step``'s)
        with its precision floor and noise envelope (``layer``: the layer, loaded once for all
        of them)."""
        envelope = None
        if not self.settings.no_precision_floor:
            floor, floor_routing = self.floor.evaluate(index, record.spec, record.tensors, layer=layer)
            record.tensors[FLOOR_KEY] = floor
            record.tensors.update(floor_routing)
            if self.perturbed.enabled:
                envelope = self.perturbed.envelope(
                    index,
                    record.spec,
                    record.tensors,
                    record.tensors[primary_output_name(record.spec)],
                    floor,
                    record.tensors.get(hidden_input_name(record.spec)),
                    layer=layer if self.perturbed.device == "cpu" else None,
                )
        floor_dtype = record.tensors[FLOOR_KEY].dtype if FLOOR_KEY in record.tensors else None
        metadata: dict[str, Any] = {
            "kind": "layer" if step is None else "decode",
            "layer": index,
            "call": record.spec,
            "floor_dtype": str(floor_dtype).removeprefix("torch.") if floor_dtype is not None else None,
        }
        if step is not None:
            metadata["step"] = step
        if envelope is not None:
            metadata["envelope"] = envelope.as_metadata()
        weights = None if step is not None else self.model.weights_fingerprint(index, self.torch_dtype, self.layer_path)
        try:
            path = self.store.write(
                key, record.tensors, metadata, record_extra={WEIGHTS_FIELD: weights} if weights else None
            )
        except ValueError as exc:
            what = f"layer {index}" if step is None else f"layer {index}, decode step {step}"
            raise GoldenError(f"{what}: the reference output is not usable as a golden: {exc}") from exc
        out = record.tensors[primary_output_name(record.spec)]
        return {
            "shape": list(out.shape),
            "dtype": str(out.dtype).removeprefix("torch."),
            "tensors": len(record.tensors),
            "file": str(path),
        }

    def stored_input_ids(self) -> torch.Tensor:
        entry = self.store.load(MODEL_IO_KEY, missing_hint=f"extract first: {self.extract_command(None)}")
        return entry.tensors["input_ids"]

    def verify_layer(self, index: int, layers: list[int], stored: Callable[[int], GoldenEntry]) -> LayerOutcome:
        """Re-run the reference from the stored input ids, each selected layer called with its
        stored call, and hold layer ``index``'s output against its stored golden as a target's
        is held (its envelope, its routers' near ties): a layer is judged on the inputs its
        golden was made from, so one legitimate difference (an expert chosen between two
        equal scores on another device) is not carried into every later layer's verdict."""
        run = self.run(layers, input_ids=self.stored_input_ids(), stored=stored)
        record = run.calls[index]
        entry = stored(index)
        spec = entry.metadata["call"]
        return judge_golden(
            index,
            entry.tensors,
            primary_output_name(spec),
            record.tensors[primary_output_name(record.spec)],
            record.tensors,
            self.settings,
            self.dtype_name,
            hidden_in=entry.tensors.get(hidden_input_name(spec)),
            envelope=entry.envelope_for(False),  # torch's kernels, where a reference runs, sum in float32
        )


def _prompt_kv_unknown(model: Any, layer_list: Any, name: str | None, steps: int) -> str | None:
    """Why the first decode step's past is not known to be what each layer's prompt call
    writes to an empty cache (None where it is: ``store.promptkv``)."""
    if not steps:
        return "extracted with --decode-steps 0 (a prompt golden keeps the keys and values the decode steps start from)"
    return unknown_with_cache(model, layer_list, name)


def _steps_overflow(logits: list[torch.Tensor]) -> Overflow | None:
    """The first decode step whose logits hold inf/NaN, or None."""
    for step, tensor in enumerate(logits):
        found = output_overflow(tensor, step, "the logits", all_finite_by_sum)
        if found is not None:
            return found
    return None


def _output_name(has_logits: bool) -> str:
    return "the logits" if has_logits else "the model's output (its last hidden state)"


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
