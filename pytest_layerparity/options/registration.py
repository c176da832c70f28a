"""The table's options and ini keys declared to pytest."""

from __future__ import annotations

from typing import Any

import pytest

from .table import OPTIONS


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("layerparity", "per-layer parity of model ports (pytest-layerparity)")
    for opt in OPTIONS:
        if opt.cli:
            kwargs: dict[str, Any] = {"dest": opt.option_name, "help": opt.help}
            if opt.action:
                kwargs["action"] = opt.action
                kwargs["default"] = opt.default
            else:
                kwargs["default"] = None  # None means "not given": the ini key or the default applies
                if opt.type is not None:
                    kwargs["type"] = opt.type
                if opt.choices:
                    kwargs["choices"] = opt.choices
                if opt.metavar:
                    kwargs["metavar"] = opt.metavar
            group.addoption(opt.flag, **kwargs)
        if opt.ini:
            help_text = (
                f"Default of {opt.flag}: {opt.help}"
                if opt.cli
                else f"{opt.help} For one run: -o {opt.ini_name}={opt.metavar or 'VALUE'} (was {opt.flag})."
            )
            parser.addini(opt.ini_name, help=help_text, default=None)
