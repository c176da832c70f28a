"""One session: the settings wired to the stages (the model, the golden store, the reference
side, the target side), each built when first needed.

Plain Python (no pytest), so it can be driven by the plugin or by a script
(``LayerParitySession(make_settings(...), Path.cwd())``). The methods below the wiring are
the fixture API that ``layerparity_session`` documents.
"""

from __future__ import annotations

from functools import cached_property, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .model.build import checkpoint_dtype, torch_dtype
from .model.source import ModelSource, model_dir_of
from .options import RunMode, Settings, is_url
from .report.progress import SILENT, Progress
from .selection import (
    LayerRange,
    called_selection,
    check_ranges_called,
    contiguous_runs,
    golden_layer,
    layer_key,
    parse_layer_ranges,
    parse_layers,
    uncalled_text,
)
from .store.commands import Commands, extraction_flags
from .store.golden import MODEL_LOGITS_KEY, GoldenEntry, GoldenError, GoldenStore
from .store.identity import check_store_matches

if TYPE_CHECKING:
    import torch

    from .backends.base import Backend
    from .compare.judge import LayerOutcome
    from .noise.wide_pass import FloorEvaluator
    from .ports.nxdi import NxdiPort
    from .reference.binding import WeightsBinding
    from .reference.extract import ReferenceSide
    from .replay.runner import BuildHook, TargetSide


def uncalled_layers(session: LayerParitySession) -> dict[int, str]:
    """Layer -> its class, of the layers the extraction's forward did not call on the golden
    input, as the store records them (an extraction finds them as it runs: none here)."""
    return {} if session.settings.mode == RunMode.EXTRACT else session.store.uncalled_layers()


def store_extraction_flags(settings: Settings, store: GoldenStore) -> tuple[str, ...]:
    """The flags of the extraction a suggested command repeats: this run's own when it
    extracts, else the store's (so the command writes goldens the store takes)."""
    from .errors import ModelError
    from .model.build import read_config_json
    from .reference.inputs import input_description

    s = settings
    try:
        default_dtype = checkpoint_dtype(read_config_json(store.model_dir or ""))
    except ModelError:
        default_dtype = None
    if s.mode == RunMode.EXTRACT:
        runs = 0 if s.no_precision_floor else s.envelope_samples
        header = {"dtype": s.dtype or default_dtype, "inputs": input_description(s), "envelope": {"runs": runs}}
    else:
        header = store.peek_manifest() or {}
    return extraction_flags(header, default_dtype)


def check_store_exists(session: LayerParitySession) -> None:
    """Refuse a run with no golden store at all, once (not once per layer), saying where
    the default store is looked for and the command that extracts it."""
    if session.store.read_manifest() is not None:
        return
    where = (
        ""
        if session.settings.golden_dir
        else f" (the default: layerparity-goldens/{session.store.root.name} under pytest's rootdir {session.rootpath}; "
        "give --golden-dir or set layerparity_golden_dir for another)"
    )
    raise GoldenError(
        f"no golden store at {session.store.root} (no manifest.json){where}; extract it with: "
        f"{session.commands.extract()}"
    )


class LayerParitySession:
    def __init__(
        self,
        settings: Settings,
        rootpath: Path,
        build_target_layer: BuildHook | None = None,
        build_target_model: BuildHook | None = None,
        nxdi_build_module: BuildHook | None = None,
    ) -> None:
        self.settings = settings
        self.rootpath = rootpath
        self._build_target_layer = build_target_layer
        self._build_target_model = build_target_model
        self._backend: Backend | None = None
        #: The NxDI port under --port nxdi (None: the model's own layers, or the build hook's).
        self.port: NxdiPort | None = None
        if settings.port == "nxdi":
            from .ports.nxdi import NxdiPort

            compiled = None
            if settings.compiled:
                from .ports.compiled import CompiledPrograms

                cache = settings.compile_cache
                compiled = CompiledPrograms(
                    nxdi_build_module,
                    tp_degree=settings.tp_degree,
                    ep_degree=settings.ep_degree,
                    logical_nc_config=settings.logical_nc_config,
                    root=Path(cache) if cache and not is_url(cache) else None,
                )
            tp = settings.tp_degree if compiled is None else 1  # compiled: ModelBuilder shards, in one process
            self.port = NxdiPort(lambda: self.model, settings.nxdi_app, compiled, tp)
        self.progress: Progress = SILENT  # the plugin shows bars on a terminal
        #: Why the layers' experts run as they do on a lazy device, where the session chose.
        self.experts_choice: str | None = None
        #: Lines the header ends with (the plugin's: the ini keys this run does not use).
        self.notes: list[str] = []
        #: Where the build hook is written (``path:line``), for its contract's breaches.
        self.hook_where = "pytest_layerparity_build_target_layer"
        #: The first test each kind of breach of the hook's contract was met in (named there in full).
        self.contract_breaches: dict[str, str] = {}

    # -- wiring ---------------------------------------------------------------------------

    @cached_property
    def model(self) -> ModelSource:
        s = self.settings
        experts = s.experts_implementation if s.mode == RunMode.PARITY else None
        if s.mode == RunMode.PARITY and experts is None:
            from .backends import backend_class

            backend = backend_class(s.target_name or "cpu")
            if backend.lazy and self.port is None:
                from .replay.experts import experts_for_goldens

                experts, self.experts_choice = experts_for_goldens(
                    self.store.read_manifest() or {}, s, model_dir_of(s.model), backend.free_memory()
                )
            elif backend.lazy:
                experts = "eager"
        return ModelSource(
            model_dir_of(s.model),
            layer_module=s.layer_module,
            trust_remote_code=s.trust_remote_code,
            attn_implementation=s.attn_implementation if s.mode != RunMode.PARITY else None,
            experts_implementation=experts,
        )

    @cached_property
    def selected_layers(self) -> list[int]:
        """The layers --layers names, less those the extraction's forward did not call (no goldens)."""
        layers = parse_layers(self.settings.layers, self.model.num_layers)
        return called_selection(self.settings.layers, layers, uncalled_layers(self), self.store.manifest_path)

    @cached_property
    def chains(self) -> list[LayerRange]:
        """The contiguous runs of the selected layers (what --chain and --bisect run)."""
        return contiguous_runs(self.selected_layers)

    @cached_property
    def layer_ranges(self) -> list[LayerRange]:
        if not self.settings.layer_ranges:
            return []
        ranges = parse_layer_ranges(self.settings.layer_ranges, self.model.num_layers)
        check_ranges_called(self.settings.layer_ranges, ranges, uncalled_layers(self), self.store.manifest_path)
        return ranges

    @cached_property
    def store(self) -> GoldenStore:
        model_dir = model_dir_of(self.settings.model)
        path = (
            Path(self.settings.golden_dir)
            if self.settings.golden_dir
            else self.rootpath / "layerparity-goldens" / model_dir.name
        )
        store = GoldenStore(path, model_dir=model_dir)
        store.extract_flags = store_extraction_flags(self.settings, store)
        return store

    @cached_property
    def golden_dtype_name(self) -> str:
        """The goldens' dtype by name: --dtype, else (testing) the stored goldens', else the checkpoint's."""
        if self.settings.dtype:
            return self.settings.dtype
        if self.settings.mode != RunMode.EXTRACT:
            manifest = self.store.read_manifest()
            if manifest and isinstance(manifest.get("dtype"), str):
                return manifest["dtype"]
        return checkpoint_dtype(self.model.config_json)

    @cached_property
    def golden_dtype(self) -> torch.dtype:
        """The dtype of the goldens, resolved once for every stage that runs in it."""
        return torch_dtype(self.golden_dtype_name)

    @cached_property
    def commands(self) -> Commands:
        """The next-step commands: extract goldens, re-run a failing test op by op."""
        s = self.settings
        port = ("--port", s.port) if s.port != "hf" else ()
        if s.nxdi_app:
            port += ("-o", f"layerparity_nxdi_app={s.nxdi_app}")
        return Commands(self.store.root, self.model.model_dir, s.target_name, port, self.store.extract_flags)

    def check_store_matches_model(self) -> None:
        """Refuse a store made from another model, shape or dtype, saying what differs."""
        check_store_matches(
            self.store.read_manifest(),
            self.store.manifest_path,
            self.model.model_dir,
            self.model.identity(),
            self.settings.dtype,
            self.commands.extract(force_regen=True, dtype=self.settings.dtype),
        )

    @cached_property
    def weights(self) -> WeightsBinding:
        """The store's goldens against this model's weights (each layer checked once)."""

        from .reference.binding import WeightsBinding

        extract_again = partial(self.commands.extract, force_regen=True)
        return WeightsBinding(self.model, self.store, self.golden_dtype, extract_again)

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            from .backends import create_backend

            if self.port is not None and self.port.compiled is not None:
                from .backends.neuron import CompiledProgramsBackend

                backend: Backend = CompiledProgramsBackend(self.settings.tp_degree, self.settings.compile_cache)
            else:
                backend = create_backend(self.settings.target_name or "cpu", self.settings)
            backend.setup()
            self._backend = backend
        return self._backend

    def teardown(self) -> None:
        if self.port is not None:
            self.port.stop()
        if self._backend is not None:
            self._backend.teardown()
            self._backend = None

    def cache_summary(self) -> str | None:
        """What the compile cache did in this process (None before the target started)."""
        return self._backend.cache_summary() if self._backend is not None else None

    def swap_summary(self) -> str | None:
        """What the check of the first weight swap into a compiled program found (None where
        none was swapped in this process)."""
        compiled = self.port.compiled if self.port is not None else None
        return compiled.swap_check if compiled is not None else None

    @cached_property
    def reference(self) -> ReferenceSide:
        from .reference.extract import ReferenceSide

        return ReferenceSide(
            self.settings,
            self.model,
            self.store,
            self.golden_dtype_name,
            self._floor,
            self.commands.extract,
            self.progress,
        )

    @cached_property
    def target(self) -> TargetSide:

        from .noise.perturbed_runs import PerturbedRunner
        from .replay.runner import TargetSide

        return TargetSide(
            self.settings,
            self.model,
            self.golden_dtype,
            self.backend,
            self.load_golden,
            self._floor,
            self._build_target_layer,
            self._build_target_model,
            self.store.read_manifest(),
            PerturbedRunner(
                self.model,
                self.golden_dtype,
                self.settings.envelope_samples,
                sixteen_bit_sums=self.backend.sixteen_bit_sums,
            ),
            self.progress,
            port=self.port,
            hook_where=self.hook_where,
        )

    @cached_property
    def _floor(self) -> FloorEvaluator:
        """The precision floor's evaluator, one for both sides (its skeleton built once)."""

        from .noise.wide_pass import FloorEvaluator

        return FloorEvaluator(self.model, self.golden_dtype)

    def header_lines(self) -> list[str]:
        from .compare.verdict import describe_rule

        s = self.settings
        cfg = self.model.config_json
        lines = [
            f"layerparity: model {self.model.model_dir} ({cfg.get('model_type', '?')}, {self.model.num_layers} layers)",
            f"layerparity: golden store {self.store.root}",
        ]
        uncalled = uncalled_layers(self)
        left_out = [i for i in parse_layers(s.layers, self.model.num_layers) if i in uncalled]
        if left_out:
            lines.append(f"layerparity: not tested: {uncalled_text(left_out, uncalled, self.store.manifest_path)}")
        if s.mode in (RunMode.EXTRACT, RunMode.VERIFY):
            ref = self.reference
            why = (
                ""
                if s.golden_device != "auto"
                else (" (CUDA visible)" if ref.golden_device.startswith("cuda") else " (no CUDA visible)")
            )
            streaming = " (one layer at a time)" if ref.device_map == "stream" else ""
            lines.append(
                f"layerparity: reference device {ref.golden_device}{why}, dtype {self.golden_dtype_name}, "
                f"placement {ref.device_map}{streaming}"
            )
            if s.mode == RunMode.EXTRACT:
                whole = (
                    "no whole-model logits (not under --device-map stream)"
                    if ref.device_map == "stream" and s.logits_topk
                    else f"the whole model's logits (top {s.logits_topk})"
                    if s.logits_topk
                    else "no whole-model logits"
                )
                lines.append(f"layerparity: goldens: the prompt, {s.decode_steps} decode steps per layer, {whole}")
        else:
            lines.append(f"layerparity: target {s.target_name}, dtype {self.golden_dtype_name}")
            if self.port is not None:
                lines.append(f"layerparity: port {self.port.describe()}")
            elif self._build_target_layer is not None:
                lines.append(
                    "layerparity: port hf: the layer the conftest's pytest_layerparity_build_target_layer builds"
                )
            else:
                lines.append("layerparity: port hf: the model's own HuggingFace layers")
            if self.experts_choice:
                lines.append(f"layerparity: experts: {self.experts_choice}")
        if s.mode != RunMode.EXTRACT:
            lines.append(f"layerparity: weights: {self.weights.describe(self.selected_layers)}")
        lines.append(f"layerparity: verdict: {describe_rule(s, self.golden_dtype_name)}")
        return lines + self.notes

    # -- the fixture API ------------------------------------------------------------------

    def load_golden(self, index: int | str) -> GoldenEntry:
        """Layer ``index``'s prompt golden, or the golden stored under a key (``layer_3.decode_0``)."""
        key = layer_key(index) if isinstance(index, int) else index
        layer = golden_layer(key)
        if self.settings.mode != RunMode.EXTRACT:  # a test of goldens made from other weights would judge another layer
            self.weights.check(self.selected_layers if key == MODEL_LOGITS_KEY else [] if layer is None else [layer])
        hint = f"extract it with: {self.commands.extract(None if layer is None else str(layer))}"
        return self.store.load(key, missing_hint=hint)

    def parity_layer(self, index: int) -> LayerOutcome:  # the layer alone, on its golden call
        return self.target.parity_layer(index)

    def parity_range(self, layers: LayerRange | list[int]) -> list[LayerOutcome]:
        from .replay.chains import chain  # the layers chained from the golden input of the first

        return chain(self.target, layers)

    def bisect(self, layers: list[int]) -> tuple[int | None, list[tuple[int, bool]]]:
        """The first layer whose chain from ``layers[0]`` fails (:func:`replay.chains.bisect`)."""
        from .replay.chains import bisect

        # every layer of the prefix: a layer's own (local) check fails only at that layer, and
        # "some layer failed" grows with the prefix, as bisection needs
        return bisect(layers, lambda prefix: all(o.passed for o in self.parity_range(prefix)))

    def extract_layer(self, index: int) -> dict[str, Any]:
        """Write the golden of one layer (running the reference once per session)."""
        return self.reference.extract_layer(index, self.selected_layers)

    def verify_layer(self, index: int) -> LayerOutcome:
        """Re-run the reference on the stored inputs and compare with the stored golden."""
        self.check_store_matches_model()
        return self.reference.verify_layer(index, self.selected_layers, self.load_golden)
