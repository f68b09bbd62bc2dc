"""How alert messages are worded: small pieces shared by several rules, and the story an
incident tells.

One story per incident: once the ``learning_rate`` rule has named the cause, the events
that follow from it (dead layers, vanishing or flat gradients, spikes) point back to it, and
none of them advises against it. Checks ask `Story.open` before wording advice
(``update_ratio`` never advises a higher learning rate while a learning-rate incident is
open); `Story.tell` puts the cause first among a step's events and adds the pointer to the
others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gradtrack.formats.event import AlertEvent

SHOWN_LAYERS = 8


def listed(names: Sequence[str]) -> str:
    """The first few ``names``, and how many more there are.

    >>> listed([f"l{i}" for i in range(10)])
    'l0, l1, l2, l3, l4, l5, l6, l7 and 2 more'
    """
    shown = ", ".join(names[:SHOWN_LAYERS])
    more = len(names) - SHOWN_LAYERS
    return shown + (f" and {more} more" if more > 0 else "")


def counted(n: int, noun: str) -> str:
    """``n`` with ``noun``, plural where it is not one.

    >>> counted(1, "layer"), counted(3, "layer"), counted(12000, "step")
    ('1 layer', '3 layers', '12,000 steps')
    """
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def sentence(text: str) -> str:
    """``text`` as a sentence: its first letter a capital. Messages never begin with a layer
    name, whose case is the model's.

    >>> sentence("gradient flow breaks between 2 and 5.")
    'Gradient flow breaks between 2 and 5.'
    """
    return text[:1].upper() + text[1:]


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
