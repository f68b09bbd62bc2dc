"""One story per incident: once the ``learning_rate`` rule has named the cause, the events
that follow from it (dead layers, vanishing or flat gradients, spikes) point back to it, and
none of them advises against it.

Checks ask `Story.open` before wording advice (``update_ratio`` never advises a higher
learning rate while a learning-rate incident is open); `Story.tell` puts the cause first
among a step's events and adds the pointer to the others.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradtrack.alerts.wording import listed
from gradtrack.formats.event import AlertEvent

# How long after its alert an incident still explains what follows (steps).
INCIDENT_STEPS = 1000
# The rules whose findings a too-high learning rate produces.
CONSEQUENCES = frozenset(
    {"dead", "vanishing", "update_ratio", "jump", "flow", "spike", "exploding", "nonfinite"}
)


@dataclass(frozen=True)
class Incident:
    """The learning-rate alert of ``step``: updates of up to ``ratio`` × the weights of
    ``layers`` (those that moved most), from step ``since`` on."""

    step: int
    layers: tuple[str, ...]
    ratio: float
    since: int

    def pointer(self) -> str:
        steps = (
            f"step {self.step}" if self.since == self.step else f"steps {self.since}-{self.step}"
        )
        return (
            f" This follows the learning-rate alert of step {self.step} (updates of up to "
            f"{self.ratio:.2g}x the weights of {listed(self.layers)} at {steps}): the "
            "learning rate is the likely cause — lower it first."
        )


class Story:
    """The open incident, if any, and how it is told."""

    def __init__(self) -> None:
        self.incident: Incident | None = None

    def open(self, step: int) -> Incident | None:
        """The incident that explains findings at ``step``, if one is open."""
        incident = self.incident
        if incident is None or not 0 <= step - incident.step <= INCIDENT_STEPS:
            return None
        return incident

    def tell(self, step: int, events: list[AlertEvent]) -> list[AlertEvent]:
        """The cause first; every consequence with its pointer to it."""
        incident = self.open(step)
        if incident is None:
            return events
        causes = [e for e in events if e.rule == "learning_rate"]
        told = [
            e.model_copy(update={"message": e.message + incident.pointer()})
            if e.rule in CONSEQUENCES
            else e
            for e in events
            if e.rule != "learning_rate"
        ]
        return causes + told
