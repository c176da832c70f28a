"""The command lines the plugin prints as the next step: the one place each is built."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TARGET_FLAGS = {"xla": ("--xla",), "neuron": ("--neuron",)}


def target_flags(target: str | None) -> list[str]:
    """How the command line names a target: ``--xla``, ``--neuron``, else ``--target NAME``."""
    name = target or "xla"
    return list(TARGET_FLAGS.get(name, ("--target", name)))


def extract_command(
    golden_dir: Path | str,
    model_dir: Path | str | None = None,
    layers: str | None = None,
    flags: Sequence[str] = (),
    force_regen: bool = False,
    dtype: str | None = None,
) -> str:
    """The command that (re)writes goldens into ``golden_dir`` (for ``layers``, else all), with
    ``flags`` (the extraction's settings: :func:`extraction_flags`), in ``dtype`` where given
    (in place of the flags' own); ``force_regen`` replaces a store of another extraction."""
    parts = ["pytest", "--gpu-golden", "--extract"]
    if model_dir is not None:
        parts.append(f"--model={model_dir}")
    parts.append(f"--golden-dir={golden_dir}")
    flags = list(flags)
    if dtype:
        if "--dtype" in flags:
            del flags[flags.index("--dtype") : flags.index("--dtype") + 2]
        flags = ["--dtype", dtype, *flags]
    parts += flags
    if layers:
        parts += ["--layers", layers]
    if force_regen:
        parts.append("--force-regen")
    return shlex.join(parts)


def extraction_flags(header: Mapping[str, Any], default_dtype: str | None = None) -> tuple[str, ...]:
    """The flags that make an extraction the one ``header`` (a manifest's, or a run's own)
    describes, each where it differs from its default, so a suggested command writes goldens
    the store takes: ``--dtype`` unless it is the checkpoint's own (``default_dtype``), the
    input's ``--prompt`` or ``--seq-len``/``--batch-size``/seed, ``--decode-steps``, and
    ``--envelope-samples``."""
    from ..options import DTYPES, OPTIONS

    defaults = {opt.dest: opt.default for opt in OPTIONS}
    flags: list[str] = []
    dtype = header.get("dtype")
    if dtype in DTYPES and dtype != default_dtype:
        flags += ["--dtype", dtype]
    inputs = header.get("inputs") or {}
    if inputs.get("source") == "prompt" and isinstance(inputs.get("prompt"), str):
        flags += ["--prompt", inputs["prompt"]]
    else:
        for flag, name in (("--seq-len", "seq_len"), ("--batch-size", "batch_size")):
            if isinstance(inputs.get(name), int) and inputs[name] != defaults[name]:
                flags += [flag, str(inputs[name])]
        if isinstance(inputs.get("seed"), int) and inputs["seed"] != defaults["seed"]:
            flags += ["-o", f"layerparity_seed={inputs['seed']}"]
    steps = inputs.get("decode_steps")
    if isinstance(steps, int) and steps != defaults["decode_steps"]:
        flags += ["--decode-steps", str(steps)]
    runs = (header.get("envelope") or {}).get("runs")
    if isinstance(runs, int) and runs != defaults["envelope_samples"]:
        flags += ["--envelope-samples", str(runs)]
    return tuple(flags)


def rerun_command(
    target: str | None,
    model_dir: Path | str,
    golden_dir: Path | str,
    layers: str,
    keyword: str,
    port: tuple[str, ...] = (),
) -> str:
    """The command that re-runs one failing test on the target, op by op (``--op-compare``);
    ``port`` holds the flags that chose the port (``--port nxdi``)."""
    parts = [
        "pytest",
        *target_flags(target),
        *port,
        f"--model={model_dir}",
        f"--golden-dir={golden_dir}",
        "--layers",
        layers,
        "-k",
        keyword,
        "--op-compare",
        "-vv",
    ]
    return shlex.join(parts)


@dataclass(frozen=True)
class Commands:
    """The next-step commands of one session (its store, model and target)."""

    golden_dir: Path
    model_dir: Path | None = None
    target: str | None = None
    port: tuple[str, ...] = ()
    #: The store's extraction settings as flags (:func:`extraction_flags`).
    flags: tuple[str, ...] = ()

    def extract(self, layers: str | None = None, force_regen: bool = False, dtype: str | None = None) -> str:
        return extract_command(self.golden_dir, self.model_dir, layers, self.flags, force_regen, dtype)

    def rerun(self, layers: str, keyword: str) -> str:
        assert self.model_dir is not None
        return rerun_command(self.target, self.model_dir, self.golden_dir, layers, keyword, self.port)
