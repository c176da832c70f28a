"""One session's state: the model, the golden store, the target runtime and the results.

Plain Python (no pytest imports beyond the option types), so it can be driven by the
plugin, by ``python -m pytest_layerparity`` or by a user's own script.
"""
from __future__ import annotations

import contextlib
import shlex
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

from . import __version__, modeling
from .golden import GoldenError, GoldenStore, describe_differences, layer_key
from .options import Settings
from .selection import LayerRange, parse_layer_ranges, parse_layers

DEFAULT_DTYPE = "float32"
MODEL_IO_KEY = "model_io"
REF_OUTPUT = "ref_output"
# Manifest fields that must agree for goldens to share one store.
EXTRACTION_KEYS = (
    "model.config_sha256",
    "model.num_layers",
    "model.hidden_size",
    "model.layer_module",
    "dtype",
    "reference_device",
    "inputs.source",
    "inputs.seed",
    "inputs.batch_size",
    "inputs.seq_len",
    "inputs.prompt",
)


@dataclass
class TargetRun:
    """A layer's output on the target (still on the device) and its routers' decisions."""

    output: Any
    routing: dict[str, Any]


@dataclass
class LayerOutcome:
    """The comparison of one layer's target output with its golden."""

    layer: int
    metrics: Any
    checks: list
    shape: tuple[int, ...]
    golden_dtype: str
    target_dtype: str
    noise: Any = None
    routing: list = field(default_factory=list)
    excluded_tokens: list = field(default_factory=list)
    tolerance: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(check.ok for check in self.checks)


@dataclass
class ReferenceRun:
    """What one forward pass of the reference model captured."""

    calls: dict[int, Any] = field(default_factory=dict)
    model_io: dict[str, Any] = field(default_factory=dict)
    layer_path: str = ""


class LayerParitySession:
    def __init__(self, settings: Settings, rootpath: Path, build_target_layer: Callable[..., Any] | None = None) -> None:
        self.settings = settings
        self.rootpath = rootpath
        self._build_target_layer = build_target_layer
        self._reference_run: ReferenceRun | None = None
        self._backend = None
        self._header_written = False
        self._model_io_checked = False
        self.placement: dict | None = None  # accelerate's device map of the reference model
        self.audit: dict[str, list] = {}  # streamed unit -> tensors whose dtype differs from --dtype

    # -- model ------------------------------------------------------------------------

    @cached_property
    def model_dir(self) -> Path:
        if not self.settings.model:
            raise modeling.ModelError(
                "no model given: pass --model DIR (a HuggingFace model folder) or set layerparity_model in your pytest ini"
            )
        return Path(self.settings.model)

    @cached_property
    def config_json(self) -> dict[str, Any]:
        return modeling.read_config_json(self.model_dir)

    @cached_property
    def num_layers(self) -> int:
        if self.settings.layer_module:
            return len(self.layer_list[1])
        count = modeling.layer_count_from_config(self.config_json)
        if count is None:
            return len(self.layer_list[1])
        return count

    def check_prompt(self) -> None:
        if self.settings.prompt is None:
            return
        names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if not any((self.model_dir / name).is_file() for name in names):
            raise modeling.ModelError(
                f"--prompt needs the model's tokenizer, and {self.model_dir} has none "
                f"({', '.join(names)}); drop --prompt to use seeded random token ids"
            )

    @cached_property
    def selected_layers(self) -> list[int]:
        return parse_layers(self.settings.layers, self.num_layers)

    @cached_property
    def chains(self) -> list[LayerRange]:
        """The contiguous runs of the selected layers (what --chain and --bisect run)."""
        runs: list[LayerRange] = []
        for index in self.selected_layers:
            if runs and runs[-1].last == index - 1:
                runs[-1] = LayerRange(runs[-1].first, index)
            else:
                runs.append(LayerRange(index, index))
        return runs

    @cached_property
    def layer_ranges(self) -> list[LayerRange]:
        if not self.settings.layer_ranges:
            return []
        return parse_layer_ranges(self.settings.layer_ranges, self.num_layers)

    @cached_property
    def hf_config(self) -> Any:
        config = modeling.load_hf_config(self.model_dir, self.settings.trust_remote_code)
        if self.settings.attn_implementation and self.settings.mode != "parity":
            config._attn_implementation = self.settings.attn_implementation
        return config

    @cached_property
    def skeleton(self) -> Any:
        return modeling.build_skeleton(self.target_config, self.torch_dtype, self.settings.trust_remote_code)

    @cached_property
    def target_config(self) -> Any:
        """The config the port's layers are built from: on lazy (compiled) targets the
        portable eager implementations of attention-adjacent kernels and MoE experts."""
        import copy

        config = copy.deepcopy(self.hf_config)
        if self.settings.mode == "parity" and hasattr(config, "_experts_implementation"):
            if self.settings.experts_implementation:
                config._experts_implementation = self.settings.experts_implementation
            elif self.backend.lazy:
                config._experts_implementation = "eager"
        return config

    @cached_property
    def layer_list(self) -> tuple[str, Any]:
        count = modeling.layer_count_from_config(self.config_json)
        return modeling.find_layer_list(self.skeleton, count, self.settings.layer_module)

    @cached_property
    def checkpoint(self) -> modeling.Checkpoint:
        return modeling.Checkpoint.open(self.model_dir)

    # -- dtype and store --------------------------------------------------------------

    @cached_property
    def dtype_name(self) -> str:
        if self.settings.mode == "extract":
            return self.settings.dtype or DEFAULT_DTYPE
        if self.settings.dtype:
            return self.settings.dtype
        manifest = self.manifest
        if manifest and isinstance(manifest.get("dtype"), str):
            return manifest["dtype"]
        return DEFAULT_DTYPE

    @property
    def torch_dtype(self) -> Any:
        return modeling.torch_dtype(self.dtype_name)

    @cached_property
    def store(self) -> GoldenStore:
        if self.settings.golden_dir:
            path = Path(self.settings.golden_dir)
        else:
            path = self.rootpath / "layerparity-goldens" / self.model_dir.name
        return GoldenStore(path)

    @cached_property
    def manifest(self) -> dict[str, Any] | None:
        return self.store.read_manifest()

    def model_identity(self) -> dict[str, Any]:
        return {
            "config_sha256": modeling.config_sha256(self.config_json),
            "num_layers": self.num_layers,
            "hidden_size": modeling.hidden_size_from_config(self.config_json),
            "model_type": self.config_json.get("model_type"),
        }

    def check_store_matches_model(self) -> None:
        """Refuse a store made from another model, shape or dtype, saying what differs."""
        manifest = self.manifest
        if manifest is None:
            return
        from .options import DTYPES

        if manifest.get("dtype") not in DTYPES:
            raise GoldenError(f"{self.store.manifest_path}: dtype {manifest.get('dtype')!r} is not one of "
                              f"{', '.join(DTYPES)}; extract the goldens again: {self.extract_command()}")
        expected = {"model": self.model_identity()}
        keys = ("model.config_sha256", "model.num_layers", "model.hidden_size")
        if self.settings.dtype:
            expected["dtype"] = self.settings.dtype
            keys += ("dtype",)
        differences = describe_differences(manifest, expected, keys)
        if differences:
            raise GoldenError(
                f"{self.store.manifest_path}: the goldens were made from another model or setting than "
                f"{self.model_dir} ({'; '.join(differences)}); extract them again for this model: "
                f"{self.extract_command()}"
            )

    def extract_command(self, layers: str | None = None) -> str:
        parts = ["pytest", "--gpu-golden", "--extract", f"--model={self.model_dir}", f"--golden-dir={self.store.root}"]
        if layers:
            parts += ["--layers", layers]
        return shlex.join(parts)

    @property
    def op_compare_dir(self) -> Path:
        return Path(self.settings.op_compare_dir) if self.settings.op_compare_dir else self.rootpath / "layerparity-opcompare"

    def drill_command(self, layers: str, keyword: str) -> str:
        target = self.settings.target_name or "xla"
        flag = {"xla": ["--xla"], "neuron": ["--neuron"]}.get(target, ["--target", target])
        parts = ["pytest", *flag, f"--model={self.model_dir}", f"--golden-dir={self.store.root}",
                 "--layers", layers, "-k", keyword, "--op-compare", "-vv"]
        return shlex.join(parts)

    # -- backend ------------------------------------------------------------------------

    @property
    def backend(self) -> Any:
        if self._backend is None:
            from .backends import create_backend

            backend = create_backend(self.settings.target_name or "cpu", self.settings)
            backend.setup()
            self._backend = backend
        return self._backend

    def teardown(self) -> None:
        if self._backend is not None:
            self._backend.teardown()
            self._backend = None

    # -- reference side ---------------------------------------------------------------

    @cached_property
    def golden_device(self) -> str:
        choice = self.settings.golden_device
        if choice != "auto":
            return choice
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def extraction_header(self) -> dict[str, Any]:
        import torch
        import transformers

        identity = self.model_identity()
        layer_path = self._reference_run.layer_path if self._reference_run is not None else self.layer_list[0]
        identity.update({"path": str(self.model_dir), "name": self.model_dir.name, "layer_module": layer_path})
        return {
            "created_by": f"pytest-layerparity {__version__}",
            "model": identity,
            "dtype": self.dtype_name,
            "reference_device": self.golden_device.split(":")[0],
            "inputs": self.input_description(),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        }

    def input_description(self) -> dict[str, Any]:
        if self.settings.prompt is not None:
            return {"source": "prompt", "prompt": self.settings.prompt, "seed": None,
                    "batch_size": 1, "seq_len": None}
        return {"source": "random", "prompt": None, "seed": self.settings.seed,
                "batch_size": self.settings.batch_size, "seq_len": self.settings.seq_len}

    def make_input_ids(self) -> Any:
        import torch

        if self.settings.prompt is not None:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
            except (OSError, ValueError) as exc:
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise modeling.ModelError(
                    f"--prompt needs the model's tokenizer, and {self.model_dir} has none that loads ({reason}); "
                    "drop --prompt to use seeded random token ids"
                ) from exc
            return tokenizer(self.settings.prompt, return_tensors="pt")["input_ids"]
        vocab = self.config_json.get("vocab_size") or (self.config_json.get("text_config") or {}).get("vocab_size")
        generator = torch.Generator().manual_seed(self.settings.seed)
        return torch.randint(0, int(vocab), (self.settings.batch_size, self.settings.seq_len), generator=generator)

    def stored_input_ids(self) -> Any:
        entry = self.store.load(MODEL_IO_KEY, missing_hint=f"extract first: {self.extract_command()}")
        return entry.tensors["input_ids"]

    def reference_run(self, layers: list[int], input_ids: Any | None = None) -> ReferenceRun:
        """Run the whole reference model once, capturing ``layers``' calls (cached per session)."""
        if self._reference_run is not None:
            return self._reference_run
        import torch

        from .capture import capture_calls
        from .routing import capture_routing

        streaming = self.device_map == "stream"
        model = self.load_reference_model(streaming)
        layer_path, _ = modeling.find_layer_list(model, modeling.layer_count_from_config(self.config_json), self.settings.layer_module)
        layer_list = model.get_submodule(layer_path)
        run = ReferenceRun(layer_path=layer_path)
        ids = self.make_input_ids() if input_ids is None else input_ids
        device = self.golden_device if streaming else _input_device(model)
        embeddings = model.get_input_embeddings()
        handle = embeddings.register_forward_hook(
            lambda module, args, output: run.model_io.__setitem__("embeddings", output.detach().to("cpu", copy=True))
        )
        routing: dict[int, dict[str, Any]] = {i: {} for i in layers}
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(capture_calls({i: layer_list[i] for i in layers}, run.calls.__setitem__))
                for i in layers:
                    stack.enter_context(capture_routing(layer_list[i], self.top_k, routing[i]))
                stack.enter_context(torch.no_grad())
                if streaming:
                    from .streaming import streamed

                    stack.enter_context(streamed(model, self.checkpoint, layer_path, self.torch_dtype,
                                                 self.golden_device, on_unit=self.audit_unit))
                output = model(input_ids=ids.to(device), use_cache=False)
        finally:
            handle.remove()
        for i, tensors in routing.items():
            if i in run.calls:
                run.calls[i].tensors.update(tensors)
        logits = getattr(output, "logits", None)
        if logits is None:
            logits = getattr(output, "last_hidden_state")
        run.model_io["input_ids"] = ids.cpu()
        run.model_io["logits"] = logits.detach().to("cpu", copy=True)
        self._reference_run = run
        del model
        return run

    @cached_property
    def device_map(self) -> str:
        """'stream', or an accelerate device map for the whole model."""
        choice = self.settings.device_map
        if choice:
            return choice
        from .planning import fits_whole

        return self.golden_device if fits_whole(self) else "stream"

    def load_reference_model(self, streaming: bool) -> Any:
        if streaming:
            return modeling.build_skeleton(self.hf_config, self.torch_dtype, self.settings.trust_remote_code)
        from .planning import parse_max_memory

        model_cls = modeling.model_class_for(self.hf_config, self.settings.trust_remote_code)
        kwargs: dict[str, Any] = {}
        if self.settings.max_memory:
            kwargs["max_memory"] = parse_max_memory(self.settings.max_memory)
        if self.settings.offload_folder:
            kwargs["offload_folder"] = self.settings.offload_folder
        model = model_cls.from_pretrained(
            str(self.model_dir), config=self.hf_config, dtype=self.torch_dtype,
            device_map=self.device_map, trust_remote_code=self.settings.trust_remote_code, **kwargs,
        ).eval()
        self.placement = getattr(model, "hf_device_map", None)
        return model

    def placement_summary(self) -> str:
        """Where the reference model went: modules per device, and memory in use on each
        CUDA device (the seeds' multi-GPU report)."""
        if not self.placement:
            return f"{self.device_map} on {self.golden_device}" if self.device_map == "stream" else str(self.device_map)
        counts: dict[str, int] = {}
        for device in self.placement.values():
            key = device if isinstance(device, str) else f"cuda:{device}"
            counts[key] = counts.get(key, 0) + 1
        parts = []
        for device, count in sorted(counts.items()):
            text = f"{device}: {count} modules"
            if device.startswith("cuda"):
                import torch

                index = int(device.split(":")[1]) if ":" in device else 0
                text += (f", {torch.cuda.memory_allocated(index) / 1e9:.2f} GB allocated, "
                         f"{torch.cuda.memory_reserved(index) / 1e9:.2f} GB reserved")
            parts.append(text)
        return "; ".join(parts)

    def audit_unit(self, unit: Any, module: Any) -> None:
        """The dtype audit of one streamed unit: refuse a layer that would materialise in
        float32 under a 16-bit request (the seeds' 1 TB bug), naming the tensors."""
        from .planning import dtype_audit

        report = dtype_audit(module, self.torch_dtype, keep=getattr(self.skeleton, "_keep_in_fp32_modules", None))
        self.audit[unit.path] = report.odd
        if report.fatal:
            raise modeling.ModelError(f"{unit.path}: {report.message}")

    def begin_extraction(self) -> None:
        if not self._header_written:
            self.store.begin(self.extraction_header(), compare_keys=EXTRACTION_KEYS)
            self._header_written = True

    def extract_layer(self, index: int) -> dict[str, Any]:
        """Write the golden of one layer (running the reference once per session)."""
        run = self.reference_run(self.selected_layers)
        self.begin_extraction()
        if not self._model_io_checked:
            if not self.store.verifies(MODEL_IO_KEY):  # absent or damaged: (re)write it; NaN logits are left out
                self.store.write(MODEL_IO_KEY, run.model_io, {"kind": "model_io"}, omit_nonfinite=True)
            self._model_io_checked = True
        record = run.calls[index]
        if not self.settings.no_precision_floor:
            floor, floor_routing = self.reference_floor(index, record.spec, record.tensors)
            record.tensors[REF_OUTPUT] = floor
            record.tensors.update(floor_routing)
        try:
            self.store.write(layer_key(index), record.tensors, {
                "kind": "layer", "layer": index, "call": record.spec,
                "ref_dtype": str(record.tensors[REF_OUTPUT].dtype).removeprefix("torch.") if REF_OUTPUT in record.tensors else None,
            })
        except ValueError as exc:
            raise GoldenError(f"layer {index}: the reference output is not usable as a golden: {exc}") from exc
        from .capture import primary_output_name

        out = record.tensors[primary_output_name(record.spec)]
        return {"shape": list(out.shape), "dtype": str(out.dtype).removeprefix("torch."),
                "tensors": len(record.tensors), "file": str(self.store.root / f"layer_{index:05d}.safetensors")}

    @property
    def top_k(self) -> int | None:
        for name in ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts"):
            value = getattr(self.hf_config, name, None)
            if isinstance(value, int):
                return value
        return None

    @cached_property
    def floor_dtype(self) -> Any:
        """The dtype of the precision floor: float32 for 16-bit goldens, float64 for float32."""
        import torch

        return torch.float64 if self.torch_dtype == torch.float32 else torch.float32

    @cached_property
    def floor_skeleton(self) -> Any:
        import copy

        config = copy.deepcopy(self.hf_config)
        if hasattr(config, "_experts_implementation"):
            config._experts_implementation = "eager"  # grouped kernels have no float64
        return modeling.build_skeleton(config, self.floor_dtype, self.settings.trust_remote_code)

    def reference_floor(self, index: int, spec: Any, tensors: dict[str, Any], hidden: Any | None = None) -> Any:
        """The layer's output evaluated in higher precision (weights and inputs upcast) on
        the CPU, from the call ``spec``/``tensors`` (hidden states replaced by ``hidden``
        when given, for chains): the yardstick of the golden's own rounding error.
        Returns it with the routers' exact logits."""
        import torch

        from .capture import decode_call, first_tensor, replace_hidden_input
        from .routing import capture_routing, ref_routing

        layer = modeling.load_layer(self.floor_skeleton, self.checkpoint, self.layer_list[0], index, self.floor_dtype).eval()
        upcast = {k: (v.to(self.floor_dtype) if torch.is_floating_point(v) else v) for k, v in tensors.items()}
        if hidden is not None:
            upcast = replace_hidden_input(spec, upcast, hidden)
        args, kwargs = decode_call(spec, upcast)
        routing: dict[str, Any] = {}
        with torch.no_grad(), capture_routing(layer, self.top_k, routing):
            out = first_tensor(layer(*args, **kwargs))
        del layer, args, kwargs, upcast
        modeling.give_back_memory()
        return out.detach().to("cpu", self.floor_dtype), ref_routing(routing)

    def verify_layer(self, index: int) -> LayerOutcome:
        """Re-run the reference from the stored input and compare with the stored golden."""
        self.check_store_matches_model()
        entry = self.load_golden(index)
        run = self.reference_run(self.selected_layers, input_ids=self.stored_input_ids())
        from .capture import primary_output_name

        record = run.calls[index]
        golden = entry.tensors[primary_output_name(entry.metadata["call"])]
        new = record.tensors[primary_output_name(record.spec)]
        return self.compare(index, golden, new, reference=entry.tensors.get(REF_OUTPUT))

    # -- target side ------------------------------------------------------------------

    def load_golden(self, index: int) -> Any:
        return self.store.load(layer_key(index), missing_hint=f"extract it with: {self.extract_command(str(index))}")

    def build_target(self, index: int) -> Any:
        layer_path = self.layer_list[0]
        reference = modeling.load_layer(self.skeleton, self.checkpoint, layer_path, index, self.torch_dtype)
        reference.eval()
        device = self.backend.device
        module = None
        if self._build_target_layer is not None:
            module = self._build_target_layer(layer_idx=index, reference_layer=reference, model_config=self.target_config, device=device)
        if module is None:
            module = reference.to(device)
        return module

    def run_layer(self, module: Any, entry: Any, hidden: Any | None = None) -> TargetRun:
        """Call ``module`` with the golden call of ``entry`` (hidden states replaced by
        ``hidden`` when given, for chained runs), recording its routers' decisions."""
        import torch

        from .capture import decode_call, first_tensor, replace_hidden_input
        from .routing import capture_routing

        spec = entry.metadata["call"]
        tensors = entry.tensors if hidden is None else replace_hidden_input(spec, entry.tensors, hidden)
        device = self.backend.device
        args, kwargs = decode_call(spec, tensors, device)
        routing: dict[str, Any] = {}
        with torch.no_grad(), capture_routing(module, self.top_k, routing):
            output = module(*args, **kwargs)
        out = first_tensor(output)
        self.backend.sync()
        return TargetRun(out, routing)

    def compare_entry(self, index: int, entry: Any, run: TargetRun, hidden_in: Any | None = None) -> LayerOutcome:
        """Hold a target run against the golden entry: metrics, precision floor, routing."""
        from .capture import hidden_input_name, primary_output_name
        from .routing import agreement, router_names

        spec = entry.metadata["call"]
        golden = entry.tensors[primary_output_name(spec)]
        if hidden_in is None:
            hidden_in = entry.tensors.get(hidden_input_name(spec))
        routings = []
        for router in router_names(entry.tensors):
            found = agreement(router, entry.tensors, run.routing, self.tie_tolerance)
            if found is not None:
                routings.append(found)
        return self.compare(index, golden, run.output, reference=entry.tensors.get(REF_OUTPUT),
                            hidden_in=hidden_in, routing=routings)

    @property
    def tie_tolerance(self) -> float:
        """Router margins (relative to the largest logit) below this count as near ties:
        a few units of the golden dtype's rounding."""
        import torch

        return self.settings.router_tie_tolerance * float(torch.finfo(self.torch_dtype).eps)

    def compare(self, index: int, golden: Any, target: Any, reference: Any | None = None,
                hidden_in: Any | None = None, routing: list | None = None) -> LayerOutcome:
        import torch

        from .metrics import compare_tensors, min_passing_tolerance
        from .noise import noise_stats
        from .verdict import evaluate

        target_cpu = target.detach().to("cpu")
        if tuple(golden.shape) != tuple(target_cpu.shape):
            raise AssertionError(
                f"layer {index}: the target's output has shape {tuple(target_cpu.shape)}, the golden "
                f"{tuple(golden.shape)}; the port returns something else than the reference layer"
            )
        routing = routing or []
        near_ties = sorted({t for r in routing for t in r.near_tie_tokens})
        rows = golden.numel() // golden.shape[-1] if golden.dim() > 1 else 1
        noise_keep = None  # the verdict leaves near-tie routing flips out unless --strict-routing
        if near_ties and golden.dim() > 1 and not self.settings.strict_routing:
            noise_keep = torch.ones(rows, dtype=torch.bool)
            noise_keep[near_ties] = False
        excluded = near_ties if self.settings.exclude_near_ties and noise_keep is not None else []
        g_cmp, t_cmp = golden, target_cpu
        if excluded:
            g_cmp = golden.reshape(-1, golden.shape[-1])[noise_keep]
            t_cmp = target_cpu.reshape(-1, golden.shape[-1])[noise_keep]
        metrics = compare_tensors(g_cmp, t_cmp)
        noise = None
        if reference is not None and tuple(reference.shape) == tuple(golden.shape):
            noise = noise_stats(golden, target_cpu, reference, hidden_in, noise_keep)
        checks = evaluate(metrics, self.settings, noise=noise, dtype=self.dtype_name)
        return LayerOutcome(
            layer=index, metrics=metrics, checks=checks, shape=tuple(golden.shape),
            golden_dtype=str(golden.dtype).removeprefix("torch."), target_dtype=str(target_cpu.dtype).removeprefix("torch."),
            noise=noise, routing=routing, excluded_tokens=excluded,
            tolerance=min_passing_tolerance(g_cmp, t_cmp),
        )

    def parity_layer(self, index: int) -> LayerOutcome:
        entry = self.load_golden(index)
        module = self.build_target(index)
        run = self.run_layer(module, entry)
        if self.settings.save_outputs:
            self.save_output(index, entry, run)
        return self.compare_entry(index, entry, run)

    @cached_property
    def output_store(self) -> GoldenStore:
        """Where --save-outputs keeps the target's outputs, in the golden format."""
        store = GoldenStore(self.settings.save_outputs)
        header = {k: v for k, v in (self.manifest or {}).items() if k not in ("files", "schema_version")}
        header["target"] = self.settings.target_name
        store.begin(header, compare_keys=EXTRACTION_KEYS + ("target",))
        return store

    def save_output(self, index: int, entry: Any, run: TargetRun) -> None:
        from .capture import primary_output_name

        spec = entry.metadata["call"]
        tensors = {k: v for k, v in entry.tensors.items() if not k.startswith(("routing.", "ref_"))}
        tensors[primary_output_name(spec)] = run.output.detach().to("cpu")
        tensors.update(run.routing)
        self.output_store.write(layer_key(index), tensors, {**entry.metadata, "target": self.settings.target_name})

    def parity_range(self, layer_range: LayerRange | list[int]) -> list[LayerOutcome]:
        """Run the layers on the target from the golden input of the first, feeding each
        layer's own output forward (a chained run, as in a real forward pass), and compare
        every layer's output with its golden. The precision floor of a chain is the same
        chain evaluated in higher precision on the CPU, so accumulated drift is judged
        against the golden's own accumulated rounding."""
        from .capture import hidden_input_name

        layers = layer_range.layers() if isinstance(layer_range, LayerRange) else list(layer_range)
        outcomes = []
        hidden = ref_hidden = None
        for index in layers:
            entry = self.load_golden(index)
            spec = entry.metadata["call"]
            if ref_hidden is None:
                ref_hidden = entry.tensors[hidden_input_name(spec)].to(self.floor_dtype)
            ref_in = ref_hidden
            run = self.run_layer(self.build_target(index), entry, hidden)
            hidden = run.output
            reference = None
            if REF_OUTPUT in entry.tensors:
                ref_hidden, _ = self.reference_floor(index, spec, entry.tensors, ref_hidden)
                reference = ref_hidden
            chained = dict(entry.tensors)
            if reference is not None:
                chained[REF_OUTPUT] = reference
            entry = type(entry)(entry.key, entry.path, chained, entry.metadata)
            outcomes.append(self.compare_entry(index, entry, run, hidden_in=ref_in))
        return outcomes

    def bisect(self, layers: list[int]) -> tuple[int | None, list[tuple[int, bool]]]:
        """The first layer whose chained output (from the golden input of ``layers[0]``)
        leaves tolerance, with O(log n) chained range runs, each judged at its last layer.
        Returns (first bad layer or None, [(end layer of each probe, passed)])."""
        probes: list[tuple[int, bool]] = []

        def passes(end: int) -> bool:
            outcome = self.parity_range(layers[: end + 1])[-1]
            probes.append((layers[end], outcome.passed))
            return outcome.passed

        if passes(len(layers) - 1):
            return None, probes
        lo, hi = 0, len(layers) - 1  # the chain fails at hi; find the first failing end
        while lo < hi:
            mid = (lo + hi) // 2
            if passes(mid):
                lo = mid + 1
            else:
                hi = mid
        return layers[lo], probes

    # -- description --------------------------------------------------------------------

    def header_lines(self) -> list[str]:
        s = self.settings
        lines = [f"layerparity: model {self.model_dir} ({self.config_json.get('model_type', '?')}, {self.num_layers} layers)"]
        lines.append(f"layerparity: golden store {self.store.root}")
        if s.mode in ("extract", "verify"):
            why = "" if s.golden_device != "auto" else (" (CUDA visible)" if self.golden_device.startswith("cuda") else " (no CUDA visible)")
            lines.append(f"layerparity: reference device {self.golden_device}{why}, dtype {self.dtype_name}, "
                         f"placement {self.device_map}{' (one layer at a time)' if self.device_map == 'stream' else ''}")
        else:
            lines.append(f"layerparity: target {s.target_name}, dtype {self.dtype_name}")
        from .verdict import describe_rule

        lines.append(f"layerparity: verdict: {describe_rule(s, self.dtype_name)}")
        return lines


def _input_device(model: Any) -> Any:
    embeddings = model.get_input_embeddings()
    for param in embeddings.parameters():
        if param.device.type != "meta":
            return param.device
    return next(p.device for p in model.parameters() if p.device.type != "meta")
