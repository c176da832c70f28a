"""Where the plugin keeps its session: pytest's typed stash, under one key that the plugin
and its helpers share (a module of its own, so that nothing imports the plugin for it)."""

from __future__ import annotations

import pytest

SESSION_KEY = pytest.StashKey["LayerParitySession"]()
#: A --force-regen in progress (the controller's).
REGEN_KEY = pytest.StashKey["Regeneration"]()
#: The node id of the module that holds the tests the plugin adds (``layerparity::test_...``).
NODEID = "layerparity"
