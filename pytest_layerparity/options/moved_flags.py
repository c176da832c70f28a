"""The refusal of a flag that left the command line: it names the ini key (or the option) to
write instead."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

import pytest

from .parsers import boolean
from .table import OPTIONS

#: The flags that left the command line, and what to type instead.
MOVED_FLAGS = {opt.flag: opt for opt in OPTIONS if not opt.cli}
REPLACED_FLAGS = {"--exclude-near-ties": "--near-ties exclude", "--strict-routing": "--near-ties strict"}


def moved_flag_fixes(args: Sequence[str]) -> dict[str, str]:
    """For each flag in ``args`` that is an ini key now (or part of another option): what to
    type instead, with the value it was given."""
    fixes: dict[str, str] = {}
    for i, arg in enumerate(args):
        flag, equals, value = arg.partition("=")
        if flag in REPLACED_FLAGS:
            fixes[flag] = f"{flag} is now {REPLACED_FLAGS[flag]}"
        opt = MOVED_FLAGS.get(flag)
        if opt is None:
            continue
        if opt.type is boolean:
            value = value or "true"
        elif not equals:
            following = args[i + 1] if i + 1 < len(args) else ""
            given = following and (not following.startswith("-") or _is_number(following))
            value = following if given else (opt.metavar or "VALUE")
        setting = shlex.quote(f"{opt.ini_name}={value}")
        fixes[flag] = (
            f"{flag} is an ini key now: set {opt.ini_name} in the project's pytest ini, or for one run write "
            f"-o {setting}"
        )
    return fixes


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def refuse_moved_flags(parser: pytest.Parser, args: Sequence[str]) -> None:
    """Raise UsageError, naming the ini key and ``-o``, for a flag of this table that left the
    command line (unless another plugin or a conftest declares a flag by that name)."""
    fixes = moved_flag_fixes(args)
    if not fixes:
        return
    _, unknown = parser.parse_known_and_unknown_args(args)
    unknown_flags = {arg.partition("=")[0] for arg in unknown}
    refused = [fix for flag, fix in fixes.items() if flag in unknown_flags]
    if refused:
        raise pytest.UsageError("; ".join(refused))
