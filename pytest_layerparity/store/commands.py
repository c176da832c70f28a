"""The command lines the plugin prints as the next step: the one place each is built."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

TARGET_FLAGS = {"xla": ("--xla",), "neuron": ("--neuron",)}


def target_flags(target: str | None) -> list[str]:
    """How the command line names a target: ``--xla``, ``--neuron``, else ``--target NAME``."""
    name = target or "xla"
    return list(TARGET_FLAGS.get(name, ("--target", name)))


def extract_command(
    golden_dir: Path | str, model_dir: Path | str | None = None, layers: str | None = None, dtype: str | None = None
) -> str:
    """The command that (re)writes goldens into ``golden_dir`` (for ``layers``, else all; in
    ``dtype``, else the run's own)."""
    parts = ["pytest", "--gpu-golden", "--extract"]
    if model_dir is not None:
        parts.append(f"--model={model_dir}")
    parts.append(f"--golden-dir={golden_dir}")
    if layers:
        parts += ["--layers", layers]
    if dtype:
        parts += ["--dtype", dtype]
    return shlex.join(parts)


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

    def extract(self, layers: str | None = None, dtype: str | None = None) -> str:
        return extract_command(self.golden_dir, self.model_dir, layers, dtype)

    def rerun(self, layers: str, keyword: str) -> str:
        assert self.model_dir is not None
        return rerun_command(self.target, self.model_dir, self.golden_dir, layers, keyword, self.port)
