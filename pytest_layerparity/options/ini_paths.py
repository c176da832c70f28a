"""Path options made absolute, and the refusal of a run whose ini file pytest skipped because
of how a path option was written."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from .reading import overridden_ini_keys
from .settings import Settings
from .table import OPTIONS

PATH_OPTIONS = (
    "model",
    "golden_dir",
    "parity_report",
    "save_outputs",
    "offload_folder",
    "op_compare_dir",
    "compile_cache",
)


def is_url(location: str) -> bool:
    return "://" in location


def resolve_cache_location(value: str, base: Path) -> str:
    """A local folder made absolute against ``base``; URLs (s3://, for Neuron's compile
    cache) are kept as they are."""
    if is_url(value) or Path(value).is_absolute():
        return value
    return str(base / value)


def resolve_paths(settings: Settings, config: pytest.Config) -> Settings:
    """Make path options absolute: command-line values (flags and ``-o``) against the directory
    pytest was started in, ini values against the ini file's directory (URLs stay as they are)."""
    changes = {}
    overridden = overridden_ini_keys(config)
    for opt in OPTIONS:
        if opt.dest not in PATH_OPTIONS:
            continue
        value = getattr(settings, opt.dest)
        if not value:
            continue
        from_cli = (opt.cli and config.getoption(opt.option_name) is not None) or opt.ini_name in overridden
        base = config.invocation_params.dir if from_cli or config.inipath is None else config.inipath.parent
        resolved = resolve_cache_location(value, Path(base))
        if resolved != value:
            changes[opt.dest] = resolved
    return replace(settings, **changes)


INI_FILES = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")


def check_ini_not_lost(config: pytest.Config) -> None:
    """Refuse a run whose ini file pytest skipped because of how a path option was written.

    pytest chooses its rootdir and ini file before plugins' options are known, so in
    ``--golden-dir /data/goldens`` it takes ``/data/goldens`` for a test path, looks for an
    ini above it, and (finding none) runs without the project's ``layerparity_*`` settings.
    """
    if config.inipath is not None:
        return
    by_flag = {opt.flag: opt for opt in OPTIONS if opt.dest in PATH_OPTIONS and opt.cli}
    args = list(config.invocation_params.args)
    split = [
        (flag, args[i + 1])
        for i, flag in enumerate(args[:-1])
        if flag in by_flag and Path(config.invocation_params.dir, args[i + 1]).exists()
    ]
    if not split:
        return
    start = Path(config.invocation_params.dir)
    for folder in (start, *start.parents):
        for name in INI_FILES:
            ini = folder / name
            try:
                text = ini.read_text(errors="replace") if ini.is_file() else ""
            except OSError:
                continue
            if "layerparity_" in text:
                flag, value = split[0]
                raise pytest.UsageError(
                    f"pytest read no ini file: it took {value} (the value of {flag}) for a test path when it "
                    "chose its rootdir, which it does before plugins' options are known, so the layerparity "
                    f"settings in {ini} were not read; write {flag}={value}, or add -c {ini}"
                )
