"""The target side: build the layer under test (the model's own layer, or the port a
conftest hook returns), run it on the target device with its golden call, and judge it;
alone, or chained over a range of layers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..capture.routing import capture_routing
from ..compare.floor import FLOOR_KEY
from ..compare.judge import LayerOutcome, judge_golden
from ..selection import LayerRange, layer_key
from ..store.callspec import decode_call, first_tensor, hidden_input_name, primary_output_name, replace_hidden_input
from ..store.golden import GoldenEntry, GoldenStore
from ..store.identity import EXTRACTION_KEYS

if TYPE_CHECKING:
    import torch

    from ..backends.base import Backend
    from ..options import Settings
    from ..reference.floor import FloorEvaluator
    from ..reference.model import ModelSource

BuildHook = Callable[..., Any]


@dataclass
class TargetRun:
    """A layer's output on the target (still on the device) and its routers' decisions."""

    output: torch.Tensor
    routing: dict[str, torch.Tensor]


class TargetSide:
    """Builds, runs and judges layers on one target backend."""

    def __init__(
        self,
        settings: Settings,
        model: ModelSource,
        dtype_name: str,
        backend: Backend,
        load_golden: Callable[[int], GoldenEntry],
        floor: FloorEvaluator,
        build_hook: BuildHook | None = None,
        manifest: dict[str, Any] | None = None,
    ) -> None:
        self.settings = settings
        self.model = model
        self.dtype_name = dtype_name
        self.backend = backend
        self.load_golden = load_golden
        self.floor = floor
        self.build_hook = build_hook
        self.manifest = manifest

    def build(self, index: int) -> torch.nn.Module:
        """Layer ``index`` as the port builds it (the hook), else the model's own layer,
        on the target device."""
        import torch

        reference = self.model.load_layer(index, getattr(torch, self.dtype_name))
        device = self.backend.device
        module = None
        if self.build_hook is not None:
            module = self.build_hook(
                layer_idx=index, reference_layer=reference, model_config=self.model.layer_config, device=device
            )
        return reference.to(device) if module is None else module

    def run(self, module: torch.nn.Module, entry: GoldenEntry, hidden: torch.Tensor | None = None) -> TargetRun:
        """Call ``module`` with the golden call of ``entry`` (hidden states replaced by
        ``hidden`` when given, for chained runs), recording its routers' decisions."""
        import torch

        spec = entry.metadata["call"]
        tensors = entry.tensors if hidden is None else replace_hidden_input(spec, entry.tensors, hidden)
        args, kwargs = decode_call(spec, tensors, self.backend.device)
        routing: dict[str, torch.Tensor] = {}
        with torch.no_grad(), capture_routing(module, self.model.top_k, routing):
            output = module(*args, **kwargs)
        out = first_tensor(output)
        self.backend.sync()
        return TargetRun(out, routing)

    def judge(
        self, index: int, entry: GoldenEntry, run: TargetRun, hidden_in: torch.Tensor | None = None
    ) -> LayerOutcome:
        """Hold a target run against the golden entry: metrics, precision floor, routing."""
        spec = entry.metadata["call"]
        if hidden_in is None:
            hidden_in = entry.tensors.get(hidden_input_name(spec))
        return judge_golden(
            index,
            entry.tensors,
            primary_output_name(spec),
            run.output,
            run.routing,
            self.settings,
            self.dtype_name,
            hidden_in=hidden_in,
        )

    def parity_layer(self, index: int) -> LayerOutcome:
        entry = self.load_golden(index)
        run = self.run(self.build(index), entry)
        if self.settings.save_outputs:
            self.save_output(index, entry, run)
        return self.judge(index, entry, run)

    @cached_property
    def output_store(self) -> GoldenStore:
        """Where --save-outputs keeps the target's outputs, in the golden format."""
        assert self.settings.save_outputs is not None
        store = GoldenStore(Path(self.settings.save_outputs))
        header = {k: v for k, v in (self.manifest or {}).items() if k not in ("files", "schema_version")}
        header["target"] = self.settings.target_name
        store.begin(header, compare_keys=(*EXTRACTION_KEYS, "target"))
        return store

    def save_output(self, index: int, entry: GoldenEntry, run: TargetRun) -> None:
        spec = entry.metadata["call"]
        tensors = {k: v for k, v in entry.tensors.items() if not k.startswith(("routing.", "ref_"))}
        tensors[primary_output_name(spec)] = run.output.detach().to("cpu")
        tensors.update(run.routing)
        self.output_store.write(layer_key(index), tensors, {**entry.metadata, "target": self.settings.target_name})

    def chain(self, layers: LayerRange | list[int]) -> list[LayerOutcome]:
        """Run the layers on the target from the golden input of the first, feeding each
        layer's own output forward (a chained run, as in a real forward pass), and judge
        every layer's output against its golden. The precision floor of a chain is the same
        chain evaluated in higher precision on the CPU, so accumulated drift is judged
        against the golden's own accumulated rounding."""
        indices = layers.layers() if isinstance(layers, LayerRange) else list(layers)
        outcomes = []
        hidden = ref_hidden = None
        for index in indices:
            entry = self.load_golden(index)
            spec = entry.metadata["call"]
            if ref_hidden is None:
                ref_hidden = entry.tensors[hidden_input_name(spec)].to(self.floor.dtype)
            ref_in = ref_hidden
            run = self.run(self.build(index), entry, hidden)
            hidden = run.output
            if FLOOR_KEY in entry.tensors:
                ref_hidden, _ = self.floor.evaluate(index, spec, entry.tensors, ref_hidden)
                entry = replace(entry, tensors={**entry.tensors, FLOOR_KEY: ref_hidden})
            outcomes.append(self.judge(index, entry, run, hidden_in=ref_in))
        return outcomes
