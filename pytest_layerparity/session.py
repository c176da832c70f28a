"""One session's state: the model, the golden store, the target runtime and the results.

Plain Python (no pytest imports beyond the option types), so it can be driven by the
plugin, by ``python -m pytest_layerparity`` or by a user's own script.
"""
from __future__ import annotations

import os
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
class LayerOutcome:
    """The comparison of one layer's target output with its golden."""

    layer: int
    metrics: Any
    checks: list
    shape: tuple[int, ...]
    golden_dtype: str
    target_dtype: str

    @property
    def passed(self) -> bool:
        return all(check.ok for check in self.checks)


@dataclass
class ReferenceRun:
    """What one forward pass of the reference model captured."""

    calls: dict[int, Any] = field(default_factory=dict)
    model_io: dict[str, Any] = field(default_factory=dict)


class LayerParitySession:
    def __init__(self, settings: Settings, rootpath: Path, build_target_layer: Callable[..., Any] | None = None) -> None:
        self.settings = settings
        self.rootpath = rootpath
        self._build_target_layer = build_target_layer
        self._reference_run: ReferenceRun | None = None
        self._backend = None
        self._header_written = False

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
        if self.settings.mode == "parity" and self.backend.lazy and hasattr(config, "_experts_implementation"):
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
        manifest = self.manifest
        if self.settings.dtype:
            return self.settings.dtype
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

    def drill_command(self, layers: str, keyword: str) -> str:
        target = self.settings.target_name or "xla"
        flag = {"xla": ["--xla"], "neuron": ["--neuron"]}.get(target, ["--target", target])
        parts = ["pytest", *flag, f"--model={self.model_dir}", f"--golden-dir={self.store.root}",
                 "--layers", layers, "-k", keyword, "-vv"]
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
        identity.update({"path": str(self.model_dir), "name": self.model_dir.name, "layer_module": self.layer_list[0]})
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

        model_cls = modeling.model_class_for(self.hf_config, self.settings.trust_remote_code)
        model = model_cls.from_pretrained(
            str(self.model_dir), config=self.hf_config, dtype=self.torch_dtype,
            device_map=self.golden_device, trust_remote_code=self.settings.trust_remote_code,
        ).eval()
        layer_path, _ = modeling.find_layer_list(model, modeling.layer_count_from_config(self.config_json), self.settings.layer_module)
        layer_list = model.get_submodule(layer_path)
        run = ReferenceRun()
        ids = self.make_input_ids() if input_ids is None else input_ids
        device = next(model.parameters()).device
        embeddings = model.get_input_embeddings()
        handle = embeddings.register_forward_hook(
            lambda module, args, output: run.model_io.__setitem__("embeddings", output.detach().to("cpu", copy=True))
        )
        try:
            with capture_calls({i: layer_list[i] for i in layers}, run.calls.__setitem__), torch.no_grad():
                output = model(input_ids=ids.to(device), use_cache=False)
        finally:
            handle.remove()
        logits = getattr(output, "logits", None)
        if logits is None:
            logits = getattr(output, "last_hidden_state")
        run.model_io["input_ids"] = ids.cpu()
        run.model_io["logits"] = logits.detach().to("cpu", copy=True)
        self._reference_run = run
        del model
        return run

    def begin_extraction(self) -> None:
        if not self._header_written:
            self.store.begin(self.extraction_header(), compare_keys=EXTRACTION_KEYS)
            self._header_written = True

    def extract_layer(self, index: int) -> dict[str, Any]:
        """Write the golden of one layer (running the reference once per session)."""
        self.begin_extraction()
        run = self.reference_run(self.selected_layers)
        if not self.store.has(MODEL_IO_KEY):
            self.store.write(MODEL_IO_KEY, run.model_io, {"kind": "model_io"})
        record = run.calls[index]
        try:
            self.store.write(layer_key(index), record.tensors, {"kind": "layer", "layer": index, "call": record.spec})
        except ValueError as exc:
            raise GoldenError(f"layer {index}: the reference output is not usable as a golden: {exc}") from exc
        from .capture import primary_output_name

        out = record.tensors[primary_output_name(record.spec)]
        return {"shape": list(out.shape), "dtype": str(out.dtype).removeprefix("torch."),
                "tensors": len(record.tensors), "file": str(self.store.root / f"layer_{index:05d}.safetensors")}

    def verify_layer(self, index: int) -> LayerOutcome:
        """Re-run the reference from the stored input and compare with the stored golden."""
        self.check_store_matches_model()
        entry = self.load_golden(index)
        run = self.reference_run(self.selected_layers, input_ids=self.stored_input_ids())
        from .capture import primary_output_name

        record = run.calls[index]
        golden = entry.tensors[primary_output_name(entry.metadata["call"])]
        new = record.tensors[primary_output_name(record.spec)]
        return self.compare(index, golden, new)

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

    def run_layer(self, module: Any, entry: Any, hidden: Any | None = None) -> Any:
        """Call ``module`` with the golden call of ``entry`` (hidden states replaced by
        ``hidden`` when given); returns the first output tensor, still on the device."""
        import torch

        from .capture import decode_call, first_tensor, replace_hidden_input

        spec = entry.metadata["call"]
        tensors = entry.tensors if hidden is None else replace_hidden_input(spec, entry.tensors, hidden)
        device = self.backend.device
        args, kwargs = decode_call(spec, tensors, device)
        with torch.no_grad():
            output = module(*args, **kwargs)
        return first_tensor(output)

    def compare(self, index: int, golden: Any, target: Any) -> LayerOutcome:
        from .metrics import compare_tensors
        from .verdict import evaluate

        target_cpu = target.detach().to("cpu")
        if tuple(golden.shape) != tuple(target_cpu.shape):
            raise AssertionError(
                f"layer {index}: the target's output has shape {tuple(target_cpu.shape)}, the golden "
                f"{tuple(golden.shape)}; the port returns something else than the reference layer"
            )
        metrics = compare_tensors(golden, target_cpu)
        return LayerOutcome(
            layer=index, metrics=metrics, checks=evaluate(metrics, self.settings), shape=tuple(golden.shape),
            golden_dtype=str(golden.dtype).removeprefix("torch."), target_dtype=str(target_cpu.dtype).removeprefix("torch."),
        )

    def parity_layer(self, index: int) -> LayerOutcome:
        from .capture import primary_output_name

        entry = self.load_golden(index)
        module = self.build_target(index)
        out = self.run_layer(module, entry)
        self.backend.sync()
        return self.compare(index, entry.tensors[primary_output_name(entry.metadata["call"])], out)

    def parity_range(self, layer_range: LayerRange) -> list[LayerOutcome]:
        """Run ``layer_range`` on the target from the golden input of its first layer,
        feeding each layer's output forward, and compare every layer's output."""
        from .capture import primary_output_name

        outcomes = []
        hidden = None
        for index in layer_range.layers():
            entry = self.load_golden(index)
            module = self.build_target(index)
            hidden = self.run_layer(module, entry, hidden)
            self.backend.sync()
            outcomes.append(self.compare(index, entry.tensors[primary_output_name(entry.metadata["call"])], hidden))
            del module
        return outcomes

    # -- description --------------------------------------------------------------------

    def header_lines(self) -> list[str]:
        s = self.settings
        lines = [f"layerparity: model {self.model_dir} ({self.config_json.get('model_type', '?')}, {self.num_layers} layers)"]
        lines.append(f"layerparity: golden store {self.store.root}")
        if s.mode in ("extract", "verify"):
            why = "" if s.golden_device != "auto" else (" (CUDA visible)" if self.golden_device.startswith("cuda") else " (no CUDA visible)")
            lines.append(f"layerparity: reference device {self.golden_device}{why}, dtype {self.dtype_name}")
        else:
            lines.append(f"layerparity: target {s.target_name}, dtype {self.dtype_name}")
        lines.append(
            "layerparity: verdict: fail on NaN/Inf, max_abs_diff > {:g}, mean_abs_diff > {:g}, "
            "similarity_percentage < {:g}, cosine_similarity < {:g}, pearson_correlation < {:g}".format(
                s.max_abs_diff, s.max_mean_abs_diff, s.min_similarity, s.min_cosine, s.min_pearson)
        )
        return lines


def worker_env_summary() -> str:
    return ", ".join(f"{k}={os.environ[k]}" for k in ("RANK", "WORLD_SIZE", "PYTEST_XDIST_WORKER") if k in os.environ)
