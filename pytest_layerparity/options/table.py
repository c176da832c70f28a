"""The table of every option and ini key, in one order: the order of Settings' fields."""

from __future__ import annotations

from .choice_table import CHOICE_OPTIONS
from .tooling_table import TOOLING_OPTIONS
from .verdict_table import VERDICT_OPTIONS

OPTIONS = (*CHOICE_OPTIONS, *VERDICT_OPTIONS, *TOOLING_OPTIONS)
