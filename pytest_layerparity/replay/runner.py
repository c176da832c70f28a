"""The target side: build the layer under test (the model's own layer, or the port a
conftest hook returns), run it on the target device with its golden call, and judge it,
beside a same-device control where one can be held (chained over a range of layers:
:mod:`.chains`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from ..capture.router_hooks import capture_routing
from ..compare.envelope import CONTROLLED
from ..compare.judge import LayerOutcome, judge_golden
from ..report.progress import SILENT, Progress
from ..selection import decode_key, layer_key
from ..store import promptkv
from ..store.callspec import (
    cache_argument,
    decode_call,
    first_tensor,
    hidden_input_name,
    primary_output_name,
    replace_hidden_input,
)
from ..store.golden import MODEL_IO_KEY, GoldenEntry
from ..store.kv_updates import appended_kv
from .contract import HOOK, HookedLayer, checked_model_layer
from .saved import SavedOutputs

if TYPE_CHECKING:
    import torch

    from ..backends.base import Backend
    from ..compare.envelope import Envelope
    from ..compare.logits import ModelOutcome
    from ..model.source import ModelSource
    from ..noise.perturbed_runs import PerturbedRunner
    from ..noise.wide_pass import FloorEvaluator
    from ..options import Settings
    from ..ports.nxdi import NxdiPort

BuildHook = Callable[..., Any]


@dataclass
class TargetRun:
    """A layer's output on the target (still on the device) and its routers' decisions."""

    output: torch.Tensor
    routing: dict[str, torch.Tensor]
    appended_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # the keys and values the call wrote to its cache
    prompt_kv: str | None = None  # a prompt's: "judged", or "not judged: why" (promptkv.unjudged)


class TargetSide:
    """Builds, runs and judges layers on one target backend."""

    def __init__(
        self,
        settings: Settings,
        model: ModelSource,
        golden_dtype: torch.dtype,
        backend: Backend,
        load_golden: Callable[[int | str], GoldenEntry],
        floor: FloorEvaluator,
        build_hook: BuildHook | None = None,
        build_model_hook: BuildHook | None = None,
        manifest: dict[str, Any] | None = None,
        perturbed: PerturbedRunner | None = None,
        progress: Progress = SILENT,
        port: NxdiPort | None = None,
        hook_where: str = HOOK,
    ) -> None:
        self.settings = settings
        self.model = model
        self.golden_dtype = golden_dtype
        self.golden_dtype_name = str(golden_dtype).removeprefix("torch.")  # as the store and the verdict name it
        self.backend = backend
        self.load_golden = load_golden  # a layer's prompt golden, or a golden by its key
        self.floor = floor
        self.build_hook = build_hook
        self.build_model_hook = build_model_hook
        self.manifest = manifest
        self.perturbed = perturbed  # the perturbed reference runs that make a chain's noise envelope
        self.progress = progress
        self.port = port
        self.hook_where = hook_where  # where the build hook is written, for its contract's breaches
        self._hooked: WeakKeyDictionary[Any, HookedLayer] = WeakKeyDictionary()  # the layers the hook returned

    @property
    def ported(self) -> bool:
        """Whether the layers under test are a port's: the NxDI port's, or a build hook's (which
        may also change the model's layer in place and return None)."""
        return self.port is not None or self.build_hook is not None

    @property
    def compiled(self) -> bool:
        """Whether the layers under test are the NxDI port's compiled programs."""
        return self.port is not None and self.port.compiled is not None

    @property
    def controllable(self) -> bool:
        """Whether a same-device control can be held beside the layers under test: a port's
        (the model's own layer would be its own control) that is not one compiled program (its
        control would be a program of its own to compile)."""
        return self.ported and not self.compiled

    def build(self, index: int) -> torch.nn.Module:
        """Layer ``index`` as the port builds it (the NxDI port under --port nxdi, else the
        hook), else the model's own layer, on the target device."""
        if self.port is not None:
            return self._build_port(index)
        reference = self.own_layer(index, on_device=False)
        device = self.backend.device
        module = None
        if self.build_hook is not None:
            module = self.build_hook(
                layer_idx=index, reference_layer=reference, model_config=self.model.layer_config, device=device
            )
        if module is None:
            return reference.to(device)
        hooked = HookedLayer(index, type(reference), self.hook_where)
        hooked.check_device(module, device)
        self._hooked[module] = hooked
        return module

    def own_layer(self, index: int, on_device: bool = True) -> torch.nn.Module:
        """The model's own layer ``index`` from the checkpoint in the goldens' dtype (on the
        target device unless not ``on_device``): what a port is held beside in a control."""

        layer = self.model.load_layer(index, self.golden_dtype)
        return layer.to(self.backend.device) if on_device else layer

    @cached_property
    def _port_shape(self) -> tuple[int, int]:
        """(batch, prompt + decode tokens) of the goldens' input ids, read once."""
        ids = self.load_golden(MODEL_IO_KEY).tensors["input_ids"]
        steps = int(((self.manifest or {}).get("inputs") or {}).get("decode_steps") or 0)
        return int(ids.shape[0]), int(ids.shape[1]) + steps

    def _build_port(self, index: int) -> torch.nn.Module:
        """Layer ``index`` of the NxDI port, for the goldens' batch and length."""

        assert self.port is not None
        module = self.port.build(index, self.golden_dtype, *self._port_shape)
        return module.to(self.backend.device)

    def run(self, module: torch.nn.Module, entry: GoldenEntry, hidden: torch.Tensor | None = None) -> TargetRun:
        """Call ``module`` with the golden call of ``entry`` (hidden states replaced by
        ``hidden`` when given, for chained runs), recording its routers' decisions."""
        import torch

        spec = entry.metadata["call"]
        tensors = entry.tensors if hidden is None else replace_hidden_input(spec, entry.tensors, hidden)
        cache_name = cache_argument(module, self.model.cache_argument)  # the callee's name for it
        prompt = entry.metadata.get("kind") == "layer"
        unjudged = promptkv.unjudged(spec, module, cache_name) if prompt else None
        args, kwargs = decode_call(spec, tensors, self.backend.device, cache_name, prompt_cache=unjudged is None)
        hooked = self._hooked.get(module)
        if hooked is not None:
            hooked.check_call(module, args, kwargs)
        routing: dict[str, torch.Tensor] = {}
        with torch.no_grad(), capture_routing(module, self.model.top_k, routing), self.backend.running():
            output = module(*args, **kwargs)
            if hooked is not None:
                hooked.check_output(module, output, spec["output"])
            out = first_tensor(output)
            self.backend.sync()  # one graph: the output, the cache's keys and values, the routers' records
        if not prompt:
            return TargetRun(out, routing, appended_kv(args, kwargs, spec, tensors))
        return TargetRun(out, routing, *promptkv.written(args, kwargs, spec, tensors, unjudged))

    def judge(
        self,
        index: int,
        entry: GoldenEntry,
        run: TargetRun,
        hidden_in: torch.Tensor | None = None,
        envelope: Envelope | None = None,
        tainted: set[int] | None = None,
        control: dict[str, float] | None = None,
    ) -> LayerOutcome:
        """Hold a target run against the golden entry: metrics, precision floor, routing, and
        the noise envelope (the golden's own unless a chain measured one), its ratios' limits
        drawn with ``control`` (``Envelope.limits``)."""
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
            self.golden_dtype_name,
            hidden_in=hidden_in,
            envelope=envelope if envelope is not None else self.envelope_of(entry),
            tainted=sorted(tainted or ()),
            control=control,
        )

    def judge_port(
        self, index: int, entry: GoldenEntry, run: TargetRun, control: Callable[[], LayerOutcome] | None
    ) -> LayerOutcome:
        """:meth:`judge` of the layer under test, held beside a same-device control where one
        can be (:attr:`controllable`; ``control`` None: the run is a control itself): its
        ratios' limits are then the tighter ones (``compare.envelope.CONTROLLED_REACH``), and
        where it leaves one of them the control runs (``control()``, the model's own layer on
        the same call) and its readings draw them again (``Envelope.limits``), the control's
        outcome kept on the outcome. A control that cannot run on this device leaves the
        limits as without one."""
        if control is None or not self.controllable:
            return self.judge(index, entry, run)
        outcome = self.judge(index, entry, run, control={})
        tightened = outcome.envelope is not None and outcome.envelope.control is not None
        if not tightened or all(c.ok for c in outcome.checks if c.name in CONTROLLED):
            return outcome
        try:
            own = control()
        except Exception:  # the model's own layer may not run where the port does: the failure says so
            return self.judge(index, entry, run)
        if own.floor is None:
            return self.judge(index, entry, run)
        outcome = self.judge(index, entry, run, control={name: getattr(own.floor, name) for name in CONTROLLED})
        outcome.control = own
        return outcome

    def _golden_output(self, index: int) -> dict[str, Any] | None:
        """How layer ``index``'s golden output is made (its spec node; None without a golden)."""
        if layer_key(index) not in ((self.manifest or {}).get("files") or {}):
            return None
        return self.load_golden(index).metadata["call"]["output"]

    def envelope_of(self, entry: GoldenEntry) -> Envelope | None:
        """The golden's envelope this target is held to: a float16 golden's runs that sum its
        matmuls in float32 where the backend sums them so (``Envelope.for_target``)."""
        return entry.envelope_for(self.backend.sixteen_bit_sums)

    def parity_layer(self, index: int, control: bool = False) -> LayerOutcome:
        """Layer ``index`` on its golden call, judged; with ``control``, the model's own
        layer in its place (:meth:`own_layer`; its output is not saved)."""
        entry = self.load_golden(index)
        run = self.run(self.own_layer(index) if control else self.build(index), entry)
        if self.settings.save_outputs and not control:
            self.saved_outputs.save(index, entry, run.output, run.routing, run.appended_kv)
        outcome = self.judge_port(index, entry, run, None if control else lambda: self.parity_layer(index, True))
        outcome.prompt_kv = run.prompt_kv
        if run.prompt_kv == promptkv.JUDGED:  # the keys and values the prompt wrote to an empty cache
            self.judge_written_kv(entry, run, outcome, "prompt_")
        return outcome

    def judge_written_kv(self, entry: GoldenEntry, run: TargetRun, outcome: LayerOutcome, prefix: str) -> None:
        """Add to ``outcome`` the checks of the keys and values the call wrote to its cache
        (``compare.judge.judge_appended_kv``, their names starting with ``prefix``)."""
        from ..compare.judge import judge_appended_kv
        from ..compare.shares import written_shares

        states = bool((entry.metadata["call"].get("cache_update") or {}).get("states"))
        written = run.appended_kv
        envelope, dtype = outcome.envelope, self.golden_dtype_name
        outcome.checks += judge_appended_kv(entry.tensors, written, self.settings, dtype, envelope, states, prefix)
        if written is not None and not states:  # a state's error along itself tells nothing of a scale
            outcome.kv_self_shares.update(written_shares(entry.tensors, written))

    def parity_decode(self, index: int, steps: list[int], control: bool = False) -> list[LayerOutcome]:
        """Layer ``index`` in each decode step: fed the step's golden call (the one-token
        hidden state and the layer's past keys and values as a KV cache), judged on its
        output like a prompt test, and on the keys and values it appended to the cache;
        with ``control``, the model's own layer in its place."""
        module = self.own_layer(index) if control else self.build(index)
        outcomes = []
        for step in steps:
            entry = self.load_golden(decode_key(index, step))
            run = self.run(module, entry)
            own = None if control else lambda step=step: self.parity_decode(index, [step], control=True)[0]
            outcome = self.judge_port(index, entry, run, own)
            self.judge_written_kv(entry, run, outcome, "new_")
            outcomes.append(outcome)
        return outcomes

    def parity_model(self, entry: GoldenEntry, control: bool = False) -> ModelOutcome:
        """The whole model on the target, teacher-forced through the golden's prompt and decode
        tokens, against the golden's next-token distributions (see ``compare.logits``); with
        ``control``, the model's own transformers model (no hook, no port)."""

        from ..compare.judge import tie_tolerance
        from ..compare.logits import ModelEnvelope, judge_logits
        from ..model.steps import default_target_model, teacher_forced

        device = self.backend.device
        step = None
        if self.build_model_hook is not None and not control:
            step = self.build_model_hook(model_config=self.model.layer_config, device=device, settings=self.settings)
        if step is None:
            build = None
            if self.build_hook is not None and not control:
                build = checked_model_layer(self.build_hook, self.hook_where, self._golden_output)
            if self.port is not None and not control:

                def build(layer_idx: int, **_: Any) -> torch.nn.Module:
                    return self._build_port(layer_idx)

            step = default_target_model(self.model, self.golden_dtype, device, self.backend.sync, build)
        with self.backend.running():
            logits = teacher_forced(step, entry.tensors["input_ids"], entry.tensors.get("decode_ids"), device)
        self.backend.sync()
        return judge_logits(
            entry.tensors,
            logits,
            self.golden_dtype_name,
            tie_tolerance(self.settings, self.golden_dtype_name),
            self.settings.false_alarm_rate,
            ModelEnvelope.from_metadata(entry.metadata.get("envelope")),
        )

    @cached_property
    def saved_outputs(self) -> SavedOutputs:
        """Where --save-outputs keeps the target's outputs, in the golden format."""
        assert self.settings.save_outputs is not None
        return SavedOutputs(self.settings.save_outputs, self.manifest, self.settings.target_name)
