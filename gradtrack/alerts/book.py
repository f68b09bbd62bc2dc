"""What every rule family of an `AlertEngine` shares: the rules per layer, the cooldowns,
the patience counters, `Check`, the base class of a rule family, and the wording.

`RuleBook`: the alert rules as they apply to each layer, looked up once. A rule's fields for
one layer (per-layer overrides applied) are cached, and so is one field of one rule for every
layer at once, as an array in depth order, for the rules that check all layers in one
vectorised pass.

`Cooldowns`: turns a rule's finding into an `AlertEvent`, quiet within its cooldown. After an
event, the same rule and layer stay quiet for the rule's ``cooldown_steps``. A quiet finding
is dropped — unless the rule's action is ``"raise"``: then it is still made, marked
``silenced`` (sinks, logs and callbacks never see it), so that it raises every time.

`Runs`: per layer, how many logged steps in a row a rule's condition held (its patience).

How messages are worded: small pieces shared by several rules (`listed`, `counted`,
`sentence`), and the story an incident tells. One story per incident: once the
``learning_rate`` rule has named the cause, the events that follow from it (dead layers,
vanishing or flat gradients, spikes) point back to it, and none of them advises against it.
Checks ask `Story.open` before wording advice (``update_ratio`` never advises a higher learning
rate while a learning-rate incident is open); `Story.tell` puts the cause first among a step's
events and adds the pointer to the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradtrack.config.rules import AlertRules
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord


class RuleBook:
    """The rules of one engine, per layer; ``names`` and ``depth`` give the depth order."""

    def __init__(self, rules: AlertRules, depth_order: Sequence[str]) -> None:
        self.rules = rules
        self.names = list(depth_order)
        self.depth = {name: i for i, name in enumerate(depth_order)}
        self._rules: dict[tuple[str, str | None], Any] = {}
        self._fields: dict[tuple[str, str], np.ndarray] = {}

    def rule(self, name: str, layer: str | None) -> Any:
        """The rule ``name`` as it applies to ``layer`` (None: the total norm)."""
        key = (name, layer)
        if key not in self._rules:
            self._rules[key] = self.rules.for_layer(name, layer)
        return self._rules[key]

    def param(self, rule: str, field: str, idx: np.ndarray) -> np.ndarray:
        """One rule field for every layer (per-layer overrides applied), at ``idx``."""
        key = (rule, field)
        if key not in self._fields:
            values = [float(getattr(self.rule(rule, name), field)) for name in self.names]
            self._fields[key] = np.array(values, dtype=np.float64)
        return self._fields[key][idx]

    def enabled(self, rule: str, idx: np.ndarray) -> np.ndarray:
        """Whether ``rule`` is on, per layer at ``idx``."""
        return self.param(rule, "enabled", idx) > 0

    def positions(self, record: StepRecord) -> np.ndarray:
        """Each of the record's layers' position in depth order (the rows' ``idx``)."""
        return self.at(record.layers)

    def at(self, layers: Sequence[str]) -> np.ndarray:
        """The positions in depth order of ``layers``."""
        return np.fromiter((self.depth[name] for name in layers), np.int64, len(layers))


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
            step=record.step,
            wall_time=record.wall_time,
            rule=rule_name,
            layer=layer,
            rank=self.rank,
            silenced=silenced,
            **fields,
        )
        return [event]


class Check:
    """A rule family of an `AlertEngine`: its rules come from ``book``, its events from
    ``cooldowns`` (both shared by every family of the engine)."""

    def __init__(self, book: RuleBook, cooldowns: Cooldowns) -> None:
        self.book = book
        self.cooldowns = cooldowns


class Runs:
    """Consecutive-hit counters, one per layer in depth order."""

    def __init__(self, layers: int) -> None:
        self.counts = np.zeros(layers, dtype=np.int64)

    def advance(self, idx: np.ndarray, active: np.ndarray, hit: np.ndarray) -> np.ndarray:
        """The counters of the layers at ``idx`` after this step: +1 on a ``hit``, back to 0
        otherwise; only the ``active`` ones (their rule is on, their value usable) are kept.

        >>> runs = Runs(3)
        >>> idx = np.arange(3)
        >>> runs.advance(idx, np.array([True, True, False]), np.array([True, False, True]))
        array([1, 0, 1])
        >>> runs.counts
        array([1, 0, 0])
        """
        updated = np.where(hit, self.counts[idx] + 1, 0)
        self.counts[idx[active]] = updated[active]
        return updated


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
