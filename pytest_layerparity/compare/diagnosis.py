"""A failing test's likeliest cause: one ranked line naming the part of the layer that is
wrong, from the evidence the test has, with how sure it is.

The evidence, strongest first:

- the keys and values the call wrote (a prompt's, a decode step's appended ones): keys wrong
  and values right is what rotated keys do (rotary embedding, positions); both wrong with the
  output's error outside every stored direction points at the KV path;
- the routers: tokens that chose other experts than the golden's, off near ties, with the
  error along the experts' output point at the router;
- the error's direction: ``target - golden`` against each direction the golden stores
  (each branch's output, such as the attention's and the MLP's, the attention temperature's
  and the norms' epsilon's effect on the output: ``floor.branch.*``); the direction that
  explains the largest share of the error (its squared cosine with it) names the part. A
  scaled projection moves the output along its branch's output, a temperature or epsilon error
  along its own direction, so each is explained almost wholly by one; an error of another
  form (swapped rotary halves, swapped projections) is explained partly, and the line says so.
  A norm's weight (``floor.cause.norm_weight.*``: its output scaled) scales the input of the
  branch after it, so any error made inside that branch lies partly along it too: it is
  named only where it explains the error surely and more than every other direction does.
  Each attention head's own part of the output (``floor.heads``, sketched) is one more
  direction of the attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .parts import NORM_WEIGHT_PREFIX, direction_part

if TYPE_CHECKING:
    from .judge import LayerOutcome

#: The parts a diagnosis names, and how it words them.
PARTS = {
    "scores": "the attention scores or their temperature (scale, soft-capping, softmax)",
    "positions": "rotary embedding or positions",
    "kv": "the KV path (key/value projections or heads)",
    "attention": "the attention (its projections, heads or scores)",
    "mlp": "the MLP or experts",
    "router": "the router (its weights or how it picks experts)",
    "norm": "a norm (its epsilon, weight or bias)",
    "unclear": "no part stands out",
}
#: Below this share of the error explained, a direction's part is named as a guess.
SURE = 0.5
#: Below this share, no stored direction explains the error.
UNEXPLAINED = 0.1
#: From this share of the written values' error along themselves (token by token), they are
#: the golden's scaled: values replaced by other, unrelated ones (heads mixed up) read 0.5.
SCALED = 0.9
#: How much more of the error a norm's weight must explain than any other direction to be
#: named (a branch scaled in its input and in its output move its output almost alike: the
#: calibration models' wrong post-attention norm weight explains 4-9% more than the MLP).
WEIGHT_MARGIN = 1.02


@dataclass(frozen=True)
class Diagnosis:
    part: str  # a key of PARTS
    sureness: str  # "sure", "likely" or "a guess"
    evidence: str

    def describe(self) -> str:
        if self.part == "unclear":
            return f"diagnosis: {PARTS[self.part]} ({self.evidence})"
        return f"diagnosis: {PARTS[self.part]} ({self.sureness}: {self.evidence})"


def _failed(outcome: LayerOutcome, *names: str) -> bool:
    return any(not c.ok and c.name.startswith(names) for c in outcome.checks)


def _ranked(error_shares: dict[str, float]) -> list[tuple[float, str]]:
    """The directions of a known part by the share of the error they explain, largest first;
    the norms' weights' only where the largest of them explains it surely and passes
    :data:`WEIGHT_MARGIN`."""
    ranked = sorted(((share, name) for name, share in error_shares.items() if direction_part(name)), reverse=True)
    weights = [entry for entry in ranked if entry[1].startswith(NORM_WEIGHT_PREFIX)]
    others = [entry for entry in ranked if not entry[1].startswith(NORM_WEIGHT_PREFIX)]
    if weights and weights[0][0] >= SURE and weights[0][0] > WEIGHT_MARGIN * (others[0][0] if others else 0.0):
        return [weights[0], *others]
    return others


def diagnose(outcome: LayerOutcome) -> Diagnosis | None:
    """The likeliest part for a failing ``outcome`` (None for a passing one, or one without
    evidence: no floor, no directions, no cache)."""
    if outcome.passed:
        return None
    shares = _ranked(outcome.error_shares)
    best = shares[0] if shares else None
    keys = _failed(outcome, "prompt_keys", "new_keys", "prompt_kv", "kv_cache")
    values = _failed(outcome, "prompt_values", "new_values", "prompt_kv", "kv_cache")
    if keys and not values:
        return Diagnosis("positions", "sure", "the keys it wrote differ from the golden's, its values do not")
    scaled = outcome.kv_self_shares.get("values", 0.0)
    if values and scaled >= SCALED:
        return Diagnosis(
            "norm",
            "likely",
            f"the values it wrote are the golden's scaled token by token ({scaled:.0%} of their error along them): "
            "the attention's input is scaled, as a norm's epsilon or weight scales it",
        )
    if values and (best is None or best[0] < 0.9):
        written = "the keys and the values" if keys else "the values"
        return Diagnosis("kv", "likely", f"{written} it wrote differ from the golden's, not as a scale")
    flipped = sum(r.flipped - r.near_tie_flipped for r in outcome.routing)
    tokens = sum(r.tokens for r in outcome.routing)
    unexplained = best is None or best[0] < UNEXPLAINED
    if flipped and (unexplained or (direction_part(best[1]) == "mlp" and best[0] < SURE)):
        return Diagnosis(
            "router",
            "likely",
            f"{flipped} of {tokens} tokens chose other experts off near ties, and the experts' output does not "
            "explain the error",
        )
    if best is None:
        return None
    share, name = best
    if share < UNEXPLAINED:
        return Diagnosis("unclear", "unclear", f"no stored direction explains it (largest: {name}, {share:.0%})")
    runner = f"; next {shares[1][1]} {shares[1][0]:.0%}" if len(shares) > 1 else ""
    sureness = "sure" if share >= 0.9 else "likely" if share >= SURE else "a guess"
    return Diagnosis(direction_part(name) or "attention", sureness, f"{name} explains {share:.0%} of the error{runner}")
