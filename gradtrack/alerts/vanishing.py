"""The ``vanishing`` rule: a layer's gradient norm below a threshold (but not zero) for
``patience`` logged steps in a row."""

from __future__ import annotations

import numpy as np

from gradtrack.alerts.check import Check
from gradtrack.alerts.cooldown import Cooldowns
from gradtrack.alerts.patience import Runs
from gradtrack.alerts.rulebook import RuleBook
from gradtrack.alerts.wording import counted
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord


class VanishingCheck(Check):
    """Counts, per layer, the logged steps in a row its norm was below the threshold."""

    def __init__(self, book: RuleBook, cooldowns: Cooldowns) -> None:
        super().__init__(book, cooldowns)
        self._runs = Runs(len(book.names))

    def check(self, record: StepRecord, idx: np.ndarray) -> list[AlertEvent]:
        """The layers (``idx``: their positions in depth order) past their patience."""
        norms = record.column("norm")
        active = self.book.enabled("vanishing", idx) & np.isfinite(norms)
        threshold = self.book.param("vanishing", "threshold", idx)
        runs = self._runs.advance(idx, active, (norms > 0) & (norms < threshold))
        events: list[AlertEvent] = []
        for j in np.flatnonzero(active & (runs >= self.book.param("vanishing", "patience", idx))):
            layer, norm = record.layers[j], float(norms[j])
            events += self.cooldowns.emit(
                record, "vanishing", layer, statistic="norm", value=norm,
                threshold=float(threshold[j]),
                message=(
                    f"gradient norm of {layer} is {norm:.3g}, below {threshold[j]:.3g} "
                    f"for {counted(int(runs[j]), 'logged step')}: it barely learns. Try: "
                    "residual connections, normalisation (LayerNorm/BatchNorm), a better "
                    "initialisation (Kaiming/Xavier), or non-saturating activations (ReLU/GELU "
                    "instead of sigmoid/tanh)."
                ),
            )  # fmt: skip
        return events
