"""Which MoE experts implementation the layers under test use on a lazy device (torch-xla,
Neuron through its PJRT plugin), where each distinct graph is a compilation.

transformers' ``eager`` experts run only the experts a router picked, each on the tokens it
was given: shapes that follow the routing, so every layer (and every decode step) compiles
graphs of its own. ``batched_mm`` gathers each token's top-k experts' weights and runs one
batched matmul: shapes fixed by the call's size, so one graph serves every layer of a kind.
Its price is memory: the gathered weights, tokens x top-k copies of one expert's. It is the
default where those fit in a share of the device's free memory; the session header says
which was chosen and why.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..model.build import hidden_size_from_config, read_config_json
from ..reference.plan import itemsize, mlp_sizes
from ..reference.plan_text import gb

if TYPE_CHECKING:
    from ..options import Settings

#: batched_mm by default when its gathered weights take at most this share of the free memory.
GATHER_SHARE = 0.25


def gathered_bytes(cfg: dict[str, Any], tokens: int, item_bytes: int) -> int:
    """Bytes batched_mm gathers in one call of ``tokens`` tokens: each token's top-k experts'
    gate, up and down projections (0 for a model without experts)."""
    text = cfg.get("text_config") or cfg
    experts, top_k, inter = mlp_sizes(text)
    if not experts:
        return 0
    hidden = hidden_size_from_config(cfg) or 0
    return tokens * top_k * 3 * hidden * inter * item_bytes


def lazy_experts(cfg: dict[str, Any], tokens: int, item_bytes: int, free: int | None) -> tuple[str, str]:
    """(implementation, why) for a lazy device with ``free`` bytes of memory (None: unknown);
    no why for a model without experts."""
    need = gathered_bytes(cfg, tokens, item_bytes)
    if not need:
        return "eager", ""  # no experts
    if free is None:
        return "eager", (
            "eager (this device's free memory is unknown, so batched_mm, one graph per layer kind, is not chosen "
            f"for it: it gathers {gb(need)} per call; ask for it with -o layerparity_experts_implementation=batched_mm)"
        )
    if need <= GATHER_SHARE * free:
        return "batched_mm", (
            f"batched_mm (static shapes: one graph per layer kind; it gathers {gb(need)} of expert weights per call, "
            f"within {GATHER_SHARE:.0%} of the {gb(free)} free)"
        )
    return "eager", (
        f"eager (batched_mm would gather {gb(need)} of expert weights per call, over {GATHER_SHARE:.0%} of the "
        f"{gb(free)} free: each layer's routing compiles graphs of its own)"
    )


def experts_for_goldens(
    manifest: dict[str, Any], settings: Settings, model_dir: Path, free: int | None
) -> tuple[str, str]:
    """:func:`lazy_experts` for the calls a golden store holds (its batch, prompt length and
    dtype; the settings' where the store has no manifest yet)."""
    inputs = manifest.get("inputs") or {}
    tokens = int(inputs.get("batch_size") or settings.batch_size) * int(inputs.get("seq_len") or settings.seq_len)
    dtype = settings.dtype or manifest.get("dtype") or "float32"
    return lazy_experts(read_config_json(model_dir), tokens, itemsize(dtype), free)
