"""Runs over several processes: torchrun ranks and xdist workers (:mod:`.env`: the
decisions; :mod:`.runs`: the pytest plugin that applies them)."""
