"""Which part of a layer a stored direction (``floor.branch.<name>``, ``floor.cause.<name>``)
stands for: the diagnosis names it, the detection limits state a scale of it."""

from __future__ import annotations

#: Which part a stored direction (``floor.branch.<name>``) stands for.
DIRECTION_PARTS = {
    "attention_temperature": "scores",
    "norm_epsilon": "norm",
    "gelu_form": "mlp",
    "norm_bias": "norm",
}
#: The diagnosis's moves of one norm's weight (``floor.cause.norm_weight.<norm>``).
NORM_WEIGHT_PREFIX = "norm_weight."
#: Branch (child module) names of each part.
ATTENTION_NAMES = ("attn", "attention")
MLP_NAMES = ("mlp", "moe", "experts", "feed_forward", "ffn", "intermediate", "output")


def direction_part(name: str) -> str | None:
    """The part a stored direction stands for (None: a branch of no known part)."""
    if name in DIRECTION_PARTS:
        return DIRECTION_PARTS[name]
    if name.startswith(NORM_WEIGHT_PREFIX):  # before the words: a q/k norm sits in the attention
        return "norm"
    lowered = name.lower()
    if any(word in lowered for word in ATTENTION_NAMES):
        return "attention"
    if any(word in lowered for word in MLP_NAMES):
        return "mlp"
    return None
