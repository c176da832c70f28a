"""Command-line options and ini keys: the one table of options, the settings they make, and
the small pure functions that parse each value and raise with the fix.

The command line holds what a run chooses (mode, target, model, layers, input, verdict);
limits and pass-throughs that a project sets once are ini keys only (``layerparity_<name>``,
for one run ``-o layerparity_<name>=VALUE``). Everything that reads an option reads it here
(:func:`read_settings`), the plugin and the distributed runs alike; which runs use each
option, and the refusal of one a run does not use, is :mod:`..option_uses`.

One module per job: the value parsers (``parsers``), one option's declaration
(``declaration``), the table (``table``, in three parts), its registration with pytest
(``registration``), the refusal of flags that left the command line (``moved_flags``), the
settings and run mode (``settings``), reading them from pytest's config (``reading``) and
path options (``ini_paths``).
"""

from __future__ import annotations

from .declaration import Option
from .ini_paths import INI_FILES, PATH_OPTIONS, check_ini_not_lost, is_url, resolve_cache_location, resolve_paths
from .moved_flags import MOVED_FLAGS, REPLACED_FLAGS, moved_flag_fixes, refuse_moved_flags
from .parsers import (
    DEVICE_MAP_CHOICES,
    DTYPES,
    GOLDEN_DEVICES_HELP,
    MAX_MEMORY_FORMS,
    NEAR_TIES,
    boolean,
    correlation,
    device_map_choice,
    dtype_choice,
    golden_device,
    max_memory_spec,
    non_negative_int,
    parse_max_memory,
    percentage,
    positive_int,
    probability,
    size_bytes,
    tolerance,
)
from .reading import conftest_builds_layer, overridden_ini_keys, read_settings
from .registration import add_options
from .settings import RunMode, Settings, default_port, make_settings
from .table import OPTIONS

__all__ = [
    "DEVICE_MAP_CHOICES",
    "DTYPES",
    "GOLDEN_DEVICES_HELP",
    "INI_FILES",
    "MAX_MEMORY_FORMS",
    "MOVED_FLAGS",
    "NEAR_TIES",
    "OPTIONS",
    "PATH_OPTIONS",
    "REPLACED_FLAGS",
    "Option",
    "RunMode",
    "Settings",
    "add_options",
    "boolean",
    "check_ini_not_lost",
    "conftest_builds_layer",
    "correlation",
    "default_port",
    "device_map_choice",
    "dtype_choice",
    "golden_device",
    "is_url",
    "make_settings",
    "max_memory_spec",
    "moved_flag_fixes",
    "non_negative_int",
    "overridden_ini_keys",
    "parse_max_memory",
    "percentage",
    "positive_int",
    "probability",
    "read_settings",
    "refuse_moved_flags",
    "resolve_cache_location",
    "resolve_paths",
    "size_bytes",
    "tolerance",
]
