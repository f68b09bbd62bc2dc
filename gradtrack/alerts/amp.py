"""The ``amp`` rule: GradScaler overflow — a skipped step is ``info``; ``max_skips`` in a row
means the model itself produces Inf/NaN, whatever the scale."""

from __future__ import annotations

from gradtrack.alerts.check import Check
from gradtrack.alerts.cooldown import Cooldowns
from gradtrack.alerts.rulebook import RuleBook
from gradtrack.alerts.wording import counted
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord


class AmpCheck(Check):
    """Counts the steps in a row the GradScaler skipped."""

    def __init__(self, book: RuleBook, cooldowns: Cooldowns) -> None:
        super().__init__(book, cooldowns)
        self._skips = 0

    def check(self, record: StepRecord) -> list[AlertEvent]:
        """A step under a GradScaler (``record.amp_skipped`` is not None)."""
        rule = self.book.rule("amp", None)
        if not record.amp_skipped:
            self._skips = 0
            return []
        self._skips += 1
        if not rule.enabled:
            return []
        before, after = record.amp_scale, record.amp_scale_after
        change = f"scale {before:g}→{after:g}" if before is not None else "scale reduced"
        if self._skips >= rule.max_skips:
            return self.cooldowns.emit(
                record, "amp", None, statistic="skipped_steps", value=float(self._skips),
                threshold=float(rule.max_skips),
                message=(
                    f"GradScaler skipped {counted(self._skips, 'step')} in a row ({change}): the "
                    "gradients overflow whatever the scale. The model itself produces Inf/NaN: "
                    "check the forward numerics, lower the learning rate, or train in bf16."
                ),
            )  # fmt: skip
        return self.cooldowns.emit(
            record, "amp", None, statistic="skipped_steps", value=float(self._skips),
            threshold=float(rule.max_skips), severity="info",
            message=f"overflow: step skipped, {change}.",
        )  # fmt: skip
