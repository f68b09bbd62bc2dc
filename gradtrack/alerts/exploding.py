"""The ``exploding`` rule: a layer's gradient norm, or the total norm, above a threshold."""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from gradtrack.alerts.check import Check
from gradtrack.alerts.cooldown import Cooldowns
from gradtrack.alerts.rulebook import RuleBook
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord
from gradtrack.handoff.trips import exploding_columns


class ExplodingCheck(Check):
    """Suggests a clipping norm from ``total_norms``, the finite total norms seen so far."""

    def __init__(self, book: RuleBook, cooldowns: Cooldowns, total_norms: deque[float]) -> None:
        super().__init__(book, cooldowns)
        self.total_norms = total_norms

    def layers(self, record: StepRecord, idx: np.ndarray) -> list[AlertEvent]:
        """Every layer above its threshold; Python work only for those."""
        norms = record.column("norm")
        threshold = self.book.param("exploding", "threshold", idx)
        explodes = exploding_columns(norms, threshold, self.book.enabled("exploding", idx))
        events: list[AlertEvent] = []
        for j in np.flatnonzero(explodes):
            events += self.check(record, record.layers[j], float(norms[j]))
        return events

    def check(self, record: StepRecord, layer: str | None, norm: float) -> list[AlertEvent]:
        """``norm``, the gradient norm of ``layer`` (None: the total norm), against its rule."""
        rule = self.book.rule("exploding", layer)
        if not rule.enabled or not math.isfinite(norm) or norm <= rule.threshold:
            return []  # non-finite norms belong to the nonfinite rule
        history = [n for n in self.total_norms if n <= rule.threshold]
        clip = float(np.percentile(history, 90)) if history else rule.threshold / 10
        name = f"gradient norm of {layer}" if layer else "total gradient norm"
        return self.cooldowns.emit(
            record, "exploding", layer, statistic="norm" if layer else "total_norm",
            value=norm, threshold=rule.threshold,
            message=(
                f"{name} is {norm:.3g}, above {rule.threshold:.3g}. Try: a lower "
                "learning rate, or clipping: torch.nn.utils.clip_grad_norm_(model.parameters(), "
                f"max_norm={clip:.2g}) (the 90th percentile of the total norms seen so far)."
            ),
        )  # fmt: skip
