"""``--save-outputs``: the target's per-layer outputs kept in the golden format, for
``python -m pytest_layerparity compare``."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..compare.floor import FLOOR_PREFIX
from ..selection import layer_key
from ..store.callspec import primary_output_name
from ..store.golden import GoldenEntry, GoldenStore
from ..store.identity import EXTRACTION_KEYS

if TYPE_CHECKING:
    import torch


class SavedOutputs:
    """The store at ``folder`` that keeps a target's outputs: the goldens' calls, with the
    target's output, routers' decisions and the keys and values it wrote in the golden's
    place; its header the goldens' (``manifest``) and the ``target``'s name."""

    def __init__(self, folder: str, manifest: dict[str, Any] | None, target: str) -> None:
        self.folder = folder
        self.manifest = manifest
        self.target = target

    @cached_property
    def store(self) -> GoldenStore:
        store = GoldenStore(Path(self.folder))
        header = {k: v for k, v in (self.manifest or {}).items() if k not in ("files", "schema_version")}
        header["target"] = self.target
        store.begin(header, compare_keys=(*EXTRACTION_KEYS, "target"))
        return store

    def save(
        self,
        index: int,
        entry: GoldenEntry,
        output: torch.Tensor,
        routing: dict[str, torch.Tensor],
        written: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """Keep layer ``index``'s ``output``, its routers' decisions (``routing``) and the keys
        and values it wrote to its cache (``written``), on the call of its golden ``entry``."""
        spec = entry.metadata["call"]
        tensors = {k: v for k, v in entry.tensors.items() if not k.startswith(("routing.", FLOOR_PREFIX, "cache.new_"))}
        tensors[primary_output_name(spec)] = output.detach().to("cpu")
        if written is not None:
            tensors["cache.new_keys"], tensors["cache.new_values"] = (t.detach().to("cpu") for t in written)
        tensors.update(routing)
        self.store.write(layer_key(index), tensors, {**entry.metadata, "target": self.target})
