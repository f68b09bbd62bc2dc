"""`LayerKinds`: what each layer is compared with by the rules that compare layers (``jump``,
``flow``) — its module type, or per parameter its role
(`gradtrack.capture.layers.layer_kinds`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gradtrack.formats.record import StepRecord
from gradtrack.handoff.layout import SPARSE_KINDS


class LayerKinds:
    """The kind of each layer, in depth order (``depth``: layer name → position)."""

    def __init__(self, kinds: Sequence[str], depth: dict[str, int]) -> None:
        self._kinds = list(kinds)
        self._depth = depth

    def of(self, layer: str | None) -> str | None:
        """The kind of ``layer`` (None: the whole model has none)."""
        return None if layer is None else self._kinds[self._depth[layer]]

    def comparable(self, record: StepRecord) -> dict[str, np.ndarray]:
        """Rows (depth order) with a finite, non-zero gradient RMS, per kind of layer; layers
        with row-sparse gradients (embeddings) are compared with nothing."""
        rms = record.column("rms")
        by_kind: dict[str, list[int]] = {}
        for j in np.flatnonzero(np.isfinite(rms) & (rms > 0)):
            kind = self._kinds[self._depth[record.layers[j]]]
            if kind not in SPARSE_KINDS:
                by_kind.setdefault(kind, []).append(int(j))
        return {kind: np.array(rows) for kind, rows in by_kind.items() if len(rows) > 1}
