"""What a step left out of training (``action="skip"``) adds to its events."""

from __future__ import annotations

from gradtrack.alerts.rulebook import RuleBook
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord


def told_skipped(
    record: StepRecord, events: list[AlertEvent], book: RuleBook, rank: int
) -> list[AlertEvent]:
    """The event of a skipped step says so; a skip no rule event explains still is one."""
    note = (
        f" The optimizer step was skipped (action='skip'): weights and optimizer state "
        f"are unchanged; {record.skipped_steps} step(s) skipped so far."
    )
    rule = record.skipped_by
    for i, event in enumerate(events):
        if event.rule == rule:
            events[i] = event.model_copy(update={"message": event.message + note})
            return events
    severity = book.rule(rule or "nonfinite", None).severity
    fallback = AlertEvent(
        step=record.step, wall_time=record.wall_time, rule=rule or "skip", layer=None,
        statistic="total_norm", value=record.total_norm, threshold=None, severity=severity,
        rank=rank, message=f"step {record.step} tripped {rule} at its guard.{note}",
    )  # fmt: skip
    return [*events, fallback]
