"""Goldens bound to the weights they were extracted from: each layer's weights digested where
a test first reads its goldens (a layer at a time, never the whole checkpoint) and held against
the digest the extraction recorded, so goldens of other weights are refused, not judged."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import ModelError
from ..model.fingerprint import WEIGHTS_FIELD
from ..selection import layer_key, layer_spec
from ..store.identity import check_weights_match, recorded_weights

if TYPE_CHECKING:
    import torch

    from ..model.source import ModelSource
    from ..store.golden import GoldenStore


class WeightsBinding:
    """One store's goldens against one model's weights; ``extract_again()`` is the command
    that binds the store to these weights (a new extraction in its place)."""

    def __init__(
        self, model: ModelSource, store: GoldenStore, dtype: torch.dtype, extract_again: Callable[[], str]
    ) -> None:
        self.model = model
        self.store = store
        self.dtype = dtype
        self.extract_again = extract_again
        self._checked: set[int] = set()  # layers held to their goldens' digest (or without one), once

    def check(self, layers: list[int], unreadable_ok: bool = False) -> None:
        """Refuse the goldens of ``layers`` where the weights are not the ones they were
        extracted from (:func:`~..store.identity.check_weights_match`), where the store
        recorded a digest (one from before the digests is not checked: :meth:`describe`).
        ``unreadable_ok``: a layer whose weights cannot be read is left for its own test (the
        check before any test reads a layer that ``-k`` may deselect)."""
        layers = [i for i in layers if i not in self._checked]
        if not layers:  # each golden's load asks: the manifest is read where a layer is new
            return
        manifest = self.store.read_manifest() or {}
        layer_path = (manifest.get("model") or {}).get("layer_module")
        for index in layers:
            recorded = recorded_weights(manifest, layer_key(index), WEIGHTS_FIELD)
            if recorded is None:  # nothing to hold it to (an older store): not asked again
                self._checked.add(index)
                continue
            try:
                found = self.model.weights_fingerprint(index, self.dtype, layer_path)
            except (OSError, ModelError):
                if unreadable_ok:
                    continue
                raise
            check_weights_match(
                manifest, self.store.manifest_path, index, self.model.model_dir, recorded, found, self.extract_again()
            )
            self._checked.add(index)

    def describe(self, layers: list[int]) -> str:
        """Whether the goldens of ``layers`` are bound to the weights they came from."""
        manifest = self.store.peek_manifest()
        unbound = [i for i in layers if recorded_weights(manifest, layer_key(i), WEIGHTS_FIELD) is None]
        if not unbound:
            return "each layer's checked against the digest its goldens were extracted from, when first read"
        return (
            f"not checked for layers {layer_spec(unbound)}: the store records no digest of the weights they were "
            f"extracted from (an older extraction); extract again to bind them: {self.extract_again()}"
        )
