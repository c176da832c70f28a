"""``--force-regen``: replace a golden store by a new extraction without losing the old one
before the new one is complete. The old folder is renamed aside (``DIR.previous``), the new
extraction writes a fresh ``DIR``; when every extraction test passed the old one is removed,
otherwise the partial new one is removed and the old one renamed back. Renames within one
folder are atomic, so at every moment one whole store sits at ``DIR`` or ``DIR.previous``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


class Regeneration:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.kept = root.with_name(root.name + ".previous")
        self.started = False

    def start(self) -> None:
        """Put the existing store aside (a leftover ``.previous`` of an earlier interrupted
        regeneration is the older one: it goes)."""
        if self.root.exists():
            if self.kept.exists():
                shutil.rmtree(self.kept)
            os.rename(self.root, self.kept)
        self.started = True

    def finish(self, complete: bool) -> str | None:
        """Keep the new store when ``complete``, else put the old one back. Returns what was
        done, in a line, or None when there was nothing to do."""
        if not self.started:
            return None
        self.started = False
        if complete:
            if self.kept.exists():
                shutil.rmtree(self.kept)
                return f"--force-regen: {self.root} replaced; the previous store was removed"
            return None
        if not self.kept.exists():
            return (
                f"--force-regen: extraction incomplete; {self.root} holds what was written (there was no store before)"
            )
        if self.root.exists():
            shutil.rmtree(self.root)
        os.rename(self.kept, self.root)
        return f"--force-regen: extraction incomplete; the previous store was put back at {self.root}"
