"""The ``update_ratio`` rule: with ``update_signals``, layers whose update/weight ratio
‖ΔW‖/‖W‖ says they learn far too fast or barely at all, for ``patience`` logged steps."""

from __future__ import annotations

import numpy as np

from gradtrack.alerts.check import Check
from gradtrack.alerts.cooldown import Cooldowns
from gradtrack.alerts.patience import Runs
from gradtrack.alerts.rulebook import RuleBook
from gradtrack.alerts.story import Incident
from gradtrack.alerts.wording import counted
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord


class UpdateRatioCheck(Check):
    """Counts, per layer, the logged steps in a row its ratio was out of range."""

    def __init__(self, book: RuleBook, cooldowns: Cooldowns) -> None:
        super().__init__(book, cooldowns)
        self._runs = Runs(len(book.names))

    def check(
        self, record: StepRecord, idx: np.ndarray, cause: Incident | None = None
    ) -> list[AlertEvent]:
        """Layers that learn far too fast or barely at all, for ``patience`` logged steps.
        ``cause``: an open learning-rate incident (`gradtrack.alerts.story`), which a slow
        layer's advice must not contradict."""
        ratios = record.update_ratios()
        if ratios is None:
            return []
        active = self.book.enabled("update_ratio", idx) & np.isfinite(ratios)
        high = self.book.param("update_ratio", "high", idx)
        low = self.book.param("update_ratio", "low", idx)
        # A layer without gradient barely moves because nothing drives it: the dead rule's.
        driven = record.column("norm") > 0
        fast, slow = ratios > high, (ratios > 0) & (ratios < low) & driven
        runs = self._runs.advance(idx, active, fast | slow)
        patience = self.book.param("update_ratio", "patience", idx)
        events: list[AlertEvent] = []
        for j in np.flatnonzero(active & (runs >= patience)):
            layer, ratio = record.layers[j], float(ratios[j])
            limit = float(high[j] if fast[j] else low[j])
            finding = _finding(layer, ratio, limit, int(runs[j]), bool(fast[j]), cause is not None)
            events += self.cooldowns.emit(
                record, "update_ratio", layer, statistic="update_ratio", value=ratio,
                threshold=limit, message=finding,
            )  # fmt: skip
        return events


def _finding(layer: str, ratio: float, limit: float, run: int, fast: bool, caused: bool) -> str:
    if fast:
        return (
            f"each step moves {layer}'s weights by {ratio:.3g} of their norm, above "
            f"{limit:.3g}, for {counted(run, 'logged step')}: it learns too fast (healthy "
            "layers sit near 1e-3). Try: a lower learning rate for it (a parameter "
            "group), a longer warmup, or clipping."
        )
    slow = (
        f"each step moves {layer}'s weights by only {ratio:.3g} of their norm, "
        f"below {limit:.3g}, for {counted(run, 'logged step')}: it barely learns "
        "(healthy layers sit near 1e-3)."
    )
    if caused:  # after a too-high learning rate, never advise a higher one
        return slow
    return (
        f"{slow} Try: a higher learning rate for it, a "
        "smaller weight decay, Adam's eps below the gradient's scale, or check it "
        "is not meant to be frozen."
    )
