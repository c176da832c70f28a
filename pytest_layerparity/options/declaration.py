"""One option's declaration: its setting, flag, ini key, parser and default."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_type_hints


@dataclass(frozen=True)
class Option:
    """One option, declared once: its setting (``dest``, a field of Settings), its command-line
    flag, whether it is an ini key ``layerparity_<dest>`` too (``ini``) or only (``cli=False``:
    ``flag`` is then the flag it had, refused with the key to write), its parser and default."""

    dest: str
    flag: str
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    ini: bool = False
    action: str | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    cli: bool = True

    def __post_init__(self) -> None:
        if not (self.cli or self.ini):
            raise ValueError(f"{self.dest}: an option off the command line must be an ini key")

    @property
    def ini_name(self) -> str:
        return f"layerparity_{self.dest}"

    @property
    def option_name(self) -> str:
        """Its name in pytest's option namespace (``config.getoption``)."""
        return f"layerparity_{self.dest}"

    @property
    def value_type(self) -> Any:
        """The type of its setting: bool, int, float or str (None where its default is None)."""
        if self.action == "store_true":
            kind: Any = bool
        elif self.type is None:
            kind = str
        else:
            kind = get_type_hints(self.type).get("return", str)
        return kind | None if self.default is None else kind
