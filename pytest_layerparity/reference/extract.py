"""The reference side: run the HuggingFace model once on the golden input, capture every
selected layer's whole call and output, and write them (with the precision floor) as
goldens; or re-run it and check that the stored goldens reproduce. One run's state, shared by
the extraction and the verification: the model's placement, loading and header are
:mod:`.reference_model`'s, what the run captured :mod:`.reference_run`'s, its decode steps
:mod:`.decode_steps`' and the whole model's golden :mod:`.model_golden`'s.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ..capture.calls import called_layers, capture_calls
from ..capture.router_hooks import capture_routing
from ..compare.floor import FLOOR_KEY
from ..compare.judge import LayerOutcome, judge_golden
from ..model.build import find_layer_list, layer_count_from_config
from ..model.fingerprint import WEIGHTS_FIELD
from ..model.memory import give_back_memory
from ..noise.perturbed_runs import PerturbedRunner
from ..selection import decode_key, layer_key
from ..store import promptkv
from ..store.callspec import (
    CallRecord,
    cache_argument,
    decode_call,
    hidden_input_name,
    primary_output_name,
)
from ..store.finite import all_finite_by_sum
from ..store.golden import (
    MODEL_IO_KEY,
    MODEL_LOGITS_KEY,
    GoldenEntry,
    GoldenError,
)
from ..store.identity import EXTRACTION_KEYS
from .decode_steps import prompt_kv_unknown, record_decode_steps
from .inputs import make_input_ids
from .model_golden import model_golden
from .overflow import Overflow, OverflowWatch, ReferenceOverflow, output_overflow
from .placement import input_device
from .prompt_cache import filled, filling, prompt_cache, with_or_without
from .reference_model import ReferenceModel, output_name
from .reference_run import ReferenceRun
from .spill import SpilledCalls, SpilledKV, mapped_empty

if TYPE_CHECKING:
    import torch


class UncalledLayer(Exception):
    """A selected layer the model's forward did not call on the golden input: it has no call
    to record (the message says which layer, and why it gets no golden)."""


def uncalled_text(index: int, layer_class: str, model_class: str) -> str:
    return (
        f"layer {index} ({layer_class}) is not called by {model_class}'s forward on the golden input (the model "
        "skips it for this input, as a text-only forward skips a cross-attention layer): there is no call to "
        "record, so it gets no golden and no parity test; the other layers are tested as usual"
    )


class ReferenceSide(ReferenceModel):
    """The reference model of one session: its placement, its one forward pass (cached), and
    the goldens written from it. ``extract_command(layers, dtype=None)`` is the fix errors suggest."""

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
                run.prompt_kv = prompt_kv_unknown(model, layer_list, name, steps)
                run.uncalled = {i: type(m).__name__ for i, m in enumerate(layer_list) if i not in called}
                has_logits = getattr(output, "logits", None) is not None
                # the prompt's logits, held once: the tensor itself where it is on the CPU already;
                # streaming puts them on disk (seq x vocab: more than a layer's activations)
                logits = (output.logits if has_logits else output.last_hidden_state).detach().to("cpu")
                del output
                if watch is not None:
                    found = watch.first() or output_overflow(logits, None, output_name(has_logits), all_finite_by_sum)
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
                    record_decode_steps(
                        model, layer_list, layers, ids.to(device), run, self._capturing, steps, kv, prompt, watch
                    )
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
            run.model_golden = model_golden(model, run, device, self.settings, self.progress)
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


def _steps_overflow(logits: list[torch.Tensor]) -> Overflow | None:
    """The first decode step whose logits hold inf/NaN, or None."""
    for step, tensor in enumerate(logits):
        found = output_overflow(tensor, step, "the logits", all_finite_by_sum)
        if found is not None:
            return found
    return None
