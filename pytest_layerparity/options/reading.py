"""The settings read from pytest's config: each option's command-line value over its ini
value over its default."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from .declaration import Option
from .settings import Settings, default_port
from .table import OPTIONS


def conftest_builds_layer(config: pytest.Config) -> bool:
    """Whether a conftest (or plugin) implements ``pytest_layerparity_build_target_layer``:
    its own port of the layer."""
    hook = getattr(config.pluginmanager.hook, "pytest_layerparity_build_target_layer", None)
    return bool(hook is not None and hook.get_hookimpls())


def overridden_ini_keys(config: pytest.Config) -> set[str]:
    """The ini keys given on the command line with ``-o NAME=VALUE``."""
    overrides = getattr(config.option, "override_ini", None) or ()
    return {item.partition("=")[0].strip() for item in overrides}


def read_settings(config: pytest.Config) -> Settings:
    from_cli = overridden_ini_keys(config)
    values = {}
    for opt in OPTIONS:
        value = config.getoption(opt.option_name) if opt.cli else None
        if value is None and opt.ini:
            raw = config.getini(opt.ini_name)
            if raw not in (None, "", []):
                value = _parse_ini(opt, raw, opt.ini_name in from_cli)
        values[opt.dest] = opt.default if value is None else value
    if values["port"] is None:
        own = conftest_builds_layer(config)
        values["port"] = default_port(values["target"], values["xla"], values["neuron"], own)
    return Settings(**values)


def _parse_ini(opt: Option, raw: Any, from_cli: bool = False) -> Any:
    """An ini value (or ``-o NAME=VALUE``) parsed as the flag's value would be; a malformed
    one is a usage error that says what to write."""
    text = raw if isinstance(raw, str) else str(raw)
    where = f"-o {opt.ini_name}={text}" if from_cli else f"ini option {opt.ini_name} = {text!r}"
    if opt.choices and text.strip() not in opt.choices:
        raise pytest.UsageError(f"{where}: {text!r} is not one of {', '.join(opt.choices)}")
    if opt.type is None:
        return text.strip() if opt.choices else text
    try:
        return opt.type(text)
    except argparse.ArgumentTypeError as exc:
        raise pytest.UsageError(f"{where}: {exc}") from None
