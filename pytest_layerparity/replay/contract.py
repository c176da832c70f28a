"""What a layer that ``pytest_layerparity_build_target_layer`` returns must be: callable with
the golden call, its weights on the test's device, returning what the model's own layer
returns (the model calls it in its own loop). Each is checked where it would break, and a
breach is named with the hook, the layer and the fix, not met as a traceback inside the layer."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

HOOK = "pytest_layerparity_build_target_layer"


class ContractError(Exception):
    """A layer from the build hook that breaks its contract; ``kind`` names which part
    (``call``, ``device``, ``output``), ``index`` the layer."""

    def __init__(self, message: str, kind: str, index: int) -> None:
        super().__init__(message)
        self.kind = kind
        self.index = index


@dataclass(frozen=True)
class HookedLayer:
    """A layer the hook returned: which layer, the model's own layer class beside it, and
    where the hook is written (``path:line``)."""

    index: int
    reference: type
    where: str

    def breach(self, module: Any, what: str, fix: str, kind: str) -> ContractError:
        return ContractError(
            f"{HOOK} ({self.where}) returned for layer {self.index} a {type(module).__name__} that {what}; {fix}",
            kind,
            self.index,
        )

    def check_device(self, module: torch.nn.Module, device: Any) -> None:
        """Its parameters and buffers on ``device`` (the kind the test runs on)."""
        import torch

        want = torch.device(device).type
        for name, tensor in chain(module.named_parameters(), module.named_buffers()):
            if tensor.device.type != want:
                raise self.breach(
                    module,
                    f"holds {name} on {tensor.device} where the test runs on {device}",
                    "move it there in the hook (return the module .to(device), device being the hook's argument)",
                    "device",
                )

    def check_call(self, module: torch.nn.Module, args: list[Any], kwargs: dict[str, Any]) -> None:
        """Its forward takes the golden call (``args``, ``kwargs``): the call the model's own
        layer took, which the model's loop makes too."""
        try:
            signature = inspect.signature(module.forward)
        except (TypeError, ValueError):  # a forward whose signature cannot be read: the call will tell
            return
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            given = [f"{len(args)} positional", *kwargs]
            own = _signature_text(self.reference.forward)
            raise self.breach(
                module,
                f"cannot take the golden call ({exc}): its forward is {type(module).__name__}.forward"
                f"{_signature_text(module.forward)}, and the "
                f"call passes {', '.join(given)}",
                f"take the arguments the model's own {self.reference.__name__}.forward{own} takes (**kwargs for "
                "those the port does not use)",
                "call",
            ) from None

    def check_output(self, module: torch.nn.Module, output: Any, golden: Mapping[str, Any]) -> None:
        """It returns what the model's own layer returned (``golden``: the output's spec node):
        a tensor where that was a tensor, a tuple of as many items where that was a tuple."""
        want, have = _kind(golden), _output_kind(output)
        if want == have:
            return
        raise self.breach(
            module,
            f"returns {have} where the model's own {self.reference.__name__} returns {want}",
            f"return {want} as it does: the model calls the layer in its own loop (test_model_parity) and takes "
            "what it returns as the next layer's input",
            "output",
        )


def checked_model_layer(
    build_hook: Callable[..., Any], where: str, golden_output: Callable[[int], Mapping[str, Any] | None]
) -> Callable[..., Any]:
    """The build hook as the whole model calls it, its layers held to the contract as the
    layer tests hold them: the device at once, the call and output as the model's loop makes
    and takes them (against ``golden_output(index)``, the layer's golden output node)."""

    def build(layer_idx: int, reference_layer: Any, model_config: Any, device: Any) -> Any:
        port = build_hook(
            layer_idx=layer_idx, reference_layer=reference_layer, model_config=model_config, device=device
        )
        if port is None:
            return None
        hooked = HookedLayer(layer_idx, type(reference_layer), where)
        hooked.check_device(port, device)
        port.register_forward_pre_hook(lambda m, a, k: hooked.check_call(m, list(a), k), with_kwargs=True)
        golden = golden_output(layer_idx)
        if golden is not None:
            port.register_forward_hook(lambda m, a, out: hooked.check_output(m, out, golden))
        return port

    return build


def hook_location(function: Any) -> str:
    """``path:line`` of the hook's implementation (its name where the source is not found)."""
    try:
        return f"{inspect.getsourcefile(function)}:{inspect.getsourcelines(function)[1]}"
    except (OSError, TypeError):
        return getattr(function, "__qualname__", HOOK)


def _signature_text(function: Any) -> str:
    """``function``'s parameters as they are written, without their annotations (and without
    ``self``): what a call must fit."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return "(...)"
    empty = inspect.Parameter.empty
    parameters = [p.replace(annotation=empty) for name, p in signature.parameters.items() if name != "self"]
    return str(signature.replace(parameters=parameters, return_annotation=empty))


def _kind(node: Mapping[str, Any]) -> str:
    """How a stored output reads: ``a tensor``, ``a tuple of 2``, ``a dict``, ..."""
    if "t" in node:
        return "a tensor"
    for name in ("tuple", "list"):
        if name in node:
            return f"a {name} of {len(node[name])}"
    if "dict" in node:
        return "a dict"
    return f"a {node.get('dropped', 'value')}"


def _output_kind(output: Any) -> str:
    """How a returned output reads, told apart as the store's spec tells them apart."""
    import torch

    if isinstance(output, torch.Tensor):
        return "a tensor"
    if isinstance(output, Mapping):
        return "a dict"
    if isinstance(output, (tuple, list)):
        return f"a {'tuple' if isinstance(output, tuple) else 'list'} of {len(output)}"
    return f"a {type(output).__name__}"
