"""The ``dead`` rule: a layer whose gradient is exactly zero for ``patience`` logged steps —
dying ReLUs, saturated tanh/sigmoid units, or an unintended freeze."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gradtrack.alerts.check import Check
from gradtrack.alerts.cooldown import Cooldowns
from gradtrack.alerts.patience import Runs
from gradtrack.alerts.rulebook import RuleBook
from gradtrack.alerts.wording import counted
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord

_SATURATED = (
    "Likely: saturated tanh/sigmoid units — their derivative is exactly 0 in "
    "float32 once |x| is large (tanh beyond ~9). Try: scaling or normalising the "
    "inputs, a smaller initialisation, LayerNorm before the nonlinearity, gradient "
    "clipping; or an unintended freeze (a .detach(), torch.no_grad() or "
    "requires_grad=False upstream of this layer)."
)
_DYING_RELU = (
    "Likely: dying ReLUs — every unit's input is negative. Try: LeakyReLU/GELU, a "
    "lower learning rate, and a bias initialisation that keeps units on (zero or "
    "slightly positive; a large negative bias switches them off); or an unintended "
    "freeze (a .detach(), torch.no_grad() or requires_grad=False upstream of this "
    "layer)."
)


class DeadCheck(Check):
    """``saturating``: per layer (depth order), whether zero gradients there read as
    saturated tanh/sigmoid rather than dead ReLUs (`gradtrack.capture.layers.saturating_layers`)."""

    def __init__(self, book: RuleBook, cooldowns: Cooldowns, saturating: Sequence[bool]) -> None:
        super().__init__(book, cooldowns)
        self._saturating = list(saturating)
        self._runs = Runs(len(book.names))

    def check(self, record: StepRecord, idx: np.ndarray) -> list[AlertEvent]:
        """The layers (``idx``: their positions in depth order) past their patience."""
        norms = record.column("norm")
        finite = np.isfinite(norms)
        active = self.book.enabled("dead", idx) & finite
        runs = self._runs.advance(idx, active, norms == 0.0)
        live = finite & (norms > 0)
        events: list[AlertEvent] = []
        for j in np.flatnonzero(active & (runs >= self.book.param("dead", "patience", idx))):
            events += self._event(record, int(j), int(runs[j]), live)
        return events

    def _event(self, record: StepRecord, j: int, run: int, live: np.ndarray) -> list[AlertEvent]:
        layer = record.layers[j]
        # Where the flow stops: the deepest dead layer whose next layer still gets gradient.
        after = record.layers[j + 1] if j + 1 < len(record.layers) and live[j + 1] else None
        where = (
            f" The flow stops here: {after}, right after it, still gets gradient, so look at "
            f"what {layer} feeds (its activation) first."
            if after
            else ""
        )
        cause = _SATURATED if self._saturating[self.book.depth[layer]] else _DYING_RELU
        return self.cooldowns.emit(
            record, "dead", layer, statistic="norm", value=0.0, threshold=0.0,
            message=(
                f"gradient of {layer} has been exactly zero for "
                f"{counted(run, 'logged step')}.{where} {cause}"
            ),
        )  # fmt: skip
