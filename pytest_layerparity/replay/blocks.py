"""``--op-compare`` for a port (``--port nxdi``): the port's sub-blocks against the model's own.

Op by op against the CPU says nothing where the port already runs on the CPU; what differs there
is the port's code. So the failing layer is run once more with the port's direct sub-blocks
recorded (each one's input and output), and each sub-block the model's own layer has under the
same name (``input_layernorm``, ``mlp``, ...) is fed the port's recorded input: where the two
outputs part, that block computes otherwise. A block whose output differs only by a factor per
token (direction unchanged) is said to: for a mixture-of-experts block whose tokens chose the
same experts, that is the weights combining the experts' outputs (their normalisation or scale).
Blocks whose call differs between the two (attention takes other arguments) are listed as not
compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..store.callspec import first_tensor

if TYPE_CHECKING:
    from .runner import TargetSide

#: Relative error (||port - reference|| / ||reference||) above which a block is said to differ.
BLOCK_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 3e-3}
#: Per-token cosine above which a block's difference is a factor per token.
SAME_DIRECTION = 0.9999


@dataclass(frozen=True)
class BlockResult:
    name: str
    relative_error: float | None  # None: not compared
    note: str = ""

    def line(self, tolerance: float) -> str:
        if self.relative_error is None:
            return f"    {self.name}: not compared ({self.note})"
        verdict = "DIFFERS" if self.relative_error > tolerance else "same"
        text = f"    {self.name}: {verdict} (relative error {self.relative_error:.3g}, tolerance {tolerance:g})"
        return text + (f"; {self.note}" if self.note else "")


@dataclass(frozen=True)
class BlockFinding:
    results: list[BlockResult]
    tolerance: float

    @property
    def first_differing(self) -> str | None:
        return next(
            (r.name for r in self.results if r.relative_error is not None and r.relative_error > self.tolerance),
            None,
        )

    def text(self) -> str:
        lines = ["  block compare (each of the port's sub-blocks against the model's own, fed the port's input):"]
        lines += [r.line(self.tolerance) for r in self.results]
        return "\n".join(lines)


def _record_children(layer: torch.nn.Module, names: list[str], sink: dict[str, tuple[Any, torch.Tensor]]) -> list:
    handles = []
    for name in names:

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any, _name: str = name) -> None:
            given = args[0] if args else kwargs.get("hidden_states")
            if isinstance(given, torch.Tensor) and _name not in sink:
                sink[_name] = (given.detach(), first_tensor(output).detach())

        handles.append(layer.get_submodule(name).register_forward_hook(hook, with_kwargs=True))
    return handles


def scale_note(port: torch.Tensor, reference: torch.Tensor) -> str:
    """Whether ``port`` is ``reference`` times a factor per token (the last dimension is the
    feature one), and the factors' range."""
    p = port.double().reshape(-1, port.shape[-1])
    r = reference.double().reshape(-1, reference.shape[-1])
    keep = r.norm(dim=-1) > 0
    if not keep.any():
        return ""
    p, r = p[keep], r[keep]
    cosine = torch.nn.functional.cosine_similarity(p, r, dim=-1)
    if cosine.min().item() < SAME_DIRECTION:
        return ""
    factor = p.norm(dim=-1) / r.norm(dim=-1)
    return (
        f"every token's output points the same way (cosine >= {cosine.min().item():.6f}) but is scaled by "
        f"{factor.min().item():.3g} to {factor.max().item():.3g}: the weights combining its parts differ "
        "(for experts: the routing weights' normalisation or scale), not the parts"
    )


def block_compare(target: TargetSide, index: int) -> BlockFinding:
    """Run layer ``index`` of the port with its sub-blocks recorded, and each sub-block of the
    model's own layer of the same name on the port's recorded input."""
    dtype = target.golden_dtype
    tolerance = BLOCK_TOLERANCE.get(target.golden_dtype_name, BLOCK_TOLERANCE["float32"])
    module = target.build(index)
    port_layer = getattr(module, "layer", module)
    reference = target.model.load_layer(index, dtype)
    own = {n for n, _ in reference.named_children()}
    names = [n for n, _ in port_layer.named_children() if n in own]
    recorded: dict[str, tuple[Any, torch.Tensor]] = {}
    handles = _record_children(port_layer, names, recorded)
    try:
        target.run(module, target.load_golden(index))
    finally:
        for handle in handles:
            handle.remove()
    results = []
    for name in names:
        if name not in recorded:
            results.append(BlockResult(name, None, "the port did not call it with a tensor"))
            continue
        given, port_out = recorded[name]
        try:
            with torch.no_grad():
                ref_out = first_tensor(reference.get_submodule(name)(given.to("cpu")))
        except (TypeError, RuntimeError, ValueError) as exc:
            results.append(BlockResult(name, None, f"its call differs: {str(exc).splitlines()[0][:200]}"))
            continue
        port_out = port_out.to("cpu")
        if ref_out.shape != port_out.shape:
            results.append(BlockResult(name, None, f"shapes {tuple(port_out.shape)} and {tuple(ref_out.shape)}"))
            continue
        error = ((port_out.double() - ref_out.double()).norm() / ref_out.double().norm().clamp_min(1e-30)).item()
        note = scale_note(port_out, ref_out) if error > tolerance else ""
        results.append(BlockResult(name, error, note))
    return BlockFinding(results, tolerance)
