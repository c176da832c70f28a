"""A port that reads another norm epsilon, against the verdict: every norm of the middle
layer given one epsilon (as a port that reads another ``rms_norm_eps`` or ``layer_norm_eps``
has), at several values, and the input norm's alone; bench_verdicts' models, correct ports and
tables, with these bugs in place of its own.

    PJRT_DEVICE=CPU python bench/bench_norm_epsilon.py --models llama,qwen2,mixtral,gpt_neox \\
        --dtypes bfloat16 --skip-sweep --skip-k --one-process

Any bench_verdicts option applies. The bugs are all of the kind the ``branch_bias_norm_epsilon``
direction was built for, after it was built: a calibration set, not a held-out one.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_verdicts as bv

#: The epsilons planted (the generated models' own is 1e-6 or 1e-5).
EPSILONS = (1e-3, 3e-3, 1e-2, 3e-2)


def _set_epsilon(norm, value: float) -> bool:
    for attribute in ("variance_epsilon", "eps"):
        if isinstance(getattr(norm, attribute, None), float):
            setattr(norm, attribute, value)
            return True
    return False


def every_norm(value: float):
    """Every norm of the layer (``*norm`` modules and ``*Norm`` classes, nested ones too) at
    epsilon ``value``."""

    def plant(layer, config):
        norms = [
            module
            for name, module in layer.named_modules()
            if name.rsplit(".", 1)[-1].lower().endswith("norm") or type(module).__name__.endswith("Norm")
        ]
        return layer if sum(_set_epsilon(norm, value) for norm in norms) else None

    return plant


def input_norm(value: float):
    """The layer's input norm alone at epsilon ``value``."""

    def plant(layer, config):
        norm = bv._find(layer, "input_layernorm", "LayerNorm")
        return layer if norm is not None and _set_epsilon(norm, value) else None

    return plant


def main() -> None:
    bv.BUGS = {f"every norm's epsilon {v:g}": (every_norm(v), "calibration") for v in EPSILONS}
    bv.BUGS["input norm's epsilon 0.03"] = (input_norm(3e-2), "calibration")
    bv.DECODE_BUGS = {}
    bv.main()


if __name__ == "__main__":
    main()
