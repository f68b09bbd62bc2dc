"""`Cooldowns`: turns a rule's finding into an `AlertEvent`, quiet within its cooldown.

After an event, the same rule and layer stay quiet for the rule's ``cooldown_steps``. A
quiet finding is dropped — unless the rule's action is ``"raise"``: then it is still made,
marked ``silenced`` (sinks, logs and callbacks never see it), so that it raises every time.
"""

from __future__ import annotations

from typing import Any

from gradtrack.alerts.rulebook import RuleBook
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord


class Cooldowns:
    """The step each rule last fired at, per layer, and the events made from findings."""

    def __init__(self, book: RuleBook, rank: int) -> None:
        self.book = book
        self.rank = rank
        self._last_fired: dict[tuple[str, str | None], int] = {}

    def emit(
        self, record: StepRecord, rule_name: str, layer: str | None, **fields: Any
    ) -> list[AlertEvent]:
        """The event of ``rule_name`` at ``layer`` (None: the whole model) with ``fields``;
        none if it is silenced and the rule does not raise."""
        rule = self.book.rule(rule_name, layer)
        last = self._last_fired.get((rule_name, layer))
        # A step left out of training is told every time (each skip is an event).
        silenced = last is not None and record.step - last <= rule.cooldown_steps
        silenced &= record.skipped_by != rule_name
        if silenced and rule.action != "raise":
            return []
        if not silenced:
            self._last_fired[(rule_name, layer)] = record.step
        fields.setdefault("severity", rule.severity)
        fields.setdefault("layers", (layer,) if layer else ())
        event = AlertEvent(
            step=record.step, wall_time=record.wall_time, rule=rule_name, layer=layer,
            rank=self.rank, silenced=silenced, **fields,
        )  # fmt: skip
        return [event]
