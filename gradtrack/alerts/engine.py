"""`AlertEngine`: applies every alert rule to a step record, in one fixed order.

It composes the rule families (a module per group of rules) over the state they share: the
rules as they apply per layer (`RuleBook`), the cooldowns (`Cooldowns`), the layers' kinds
and the total norms seen so far. Then two passes over a step's events:

- `merge_layers`: one event per rule for the layers that tripped it together, led by the
  culprit. A deep model whose gradient vanishes trips the rule in hundreds of layers at
  once; that is one finding, and a tracker that notifies per alert must see it once.
- `told_skipped`: what a step left out of training (``action="skip"``) adds to its events.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

from gradtrack.alerts.book import Cooldowns, RuleBook, Story, listed, sentence
from gradtrack.alerts.flow import FlowCheck, JumpCheck, LayerKinds
from gradtrack.alerts.learning_rate import LearningRateCheck, UpdateRatioCheck
from gradtrack.alerts.magnitude import DeadCheck, ExplodingCheck, SpikeCheck, VanishingCheck
from gradtrack.alerts.nonfinite import AmpCheck, BackwardOrder, NonFiniteCheck
from gradtrack.config.rules import AlertRules
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord
from gradtrack.handoff.rules import PerStepRules


class AlertEngine:
    """Keeps the per-layer state rules need (patience runs, running averages, cooldowns)."""

    def __init__(
        self,
        rules: AlertRules,
        depth_order: Sequence[str],
        rank: int = 0,
        kinds: Sequence[str] | None = None,
        saturating: Sequence[bool] | None = None,
    ) -> None:
        """``kinds``: per layer, what it is compared with (`gradtrack.capture.layers.layer_kinds`;
        default: all alike); ``saturating``: per layer, whether zero gradients there read as
        saturated tanh/sigmoid rather than dead ReLUs
        (`gradtrack.capture.layers.saturating_layers`)."""
        self.rank = rank
        # The per-step rules, shared with skip and raise on the training thread.
        self.per_step = PerStepRules(rules, depth_order)
        self._book = RuleBook(rules, depth_order)
        cooldowns = Cooldowns(self._book, rank)
        self._kinds = LayerKinds(
            kinds if kinds is not None else ["layer"] * len(depth_order), self._book.depth
        )
        self._backward = BackwardOrder(self._book.depth)
        self._total_norms: deque[float] = deque(maxlen=1000)
        self._amp = AmpCheck(self._book, cooldowns)
        self._nonfinite = NonFiniteCheck(self._book, cooldowns, self._backward, self.per_step)
        self._exploding = ExplodingCheck(self._book, cooldowns, self._total_norms, self.per_step)
        self._vanishing = VanishingCheck(self._book, cooldowns)
        self._dead = DeadCheck(self._book, cooldowns, saturating or [False] * len(depth_order))
        self._spike = SpikeCheck(self._book, cooldowns, self.per_step)
        self._update_ratio = UpdateRatioCheck(self._book, cooldowns)
        self._story = Story()
        self._learning_rate = LearningRateCheck(self._book, cooldowns, self._story)
        self._jump = JumpCheck(self._book, cooldowns, self._kinds)
        self._flow = FlowCheck(self._book, cooldowns, self._kinds, self._total_norms)

    def set_backward_order(self, layers: Sequence[str]) -> None:
        """Layers in the order their gradients became ready in a backward pass."""
        self._backward.set(layers)

    def rule(self, name: str, layer: str | None) -> Any:
        """The rule ``name`` as it applies to ``layer`` (None: the total norm)."""
        return self._book.rule(name, layer)

    def evaluate(self, record: StepRecord) -> list[AlertEvent]:
        """The events of one step, in rule order; those of layers that tripped one rule
        together are merged into one."""
        events: list[AlertEvent] = []
        idx = self._book.positions(record)  # (its columns of the per-step rules: idx + 1)
        if record.amp_skipped is not None:
            events += self._amp.check(record)
        if not record.amp_skipped:
            events += self._nonfinite.check(record, idx)
        events += self._learning_rate.check(record, idx)  # a cause, before its consequences
        events += self._exploding.layers(record, idx)
        events += self._vanishing.check(record, idx) + self._dead.check(record, idx)
        events += self._exploding.total(record)
        events += self._spike.check(record)
        events += self._update_ratio.check(record, idx, self._story.open(record.step))
        jumps = self._jump.check(record)
        events += jumps + self._flow.check(record, broken={self._kinds.of(e.layer) for e in jumps})
        if math.isfinite(record.total_norm):
            self._total_norms.append(record.total_norm)
        events = self._story.tell(record.step, merge_layers(events, self._book))
        if record.skipped_by:
            events = told_skipped(record, events, self._book, self.rank)
        return [e.model_copy(update={"message": sentence(e.message)}) for e in events]


def merge_layers(events: list[AlertEvent], book: RuleBook) -> list[AlertEvent]:
    """One event per rule (and severity, action) for the layers that tripped together, in
    the order each group first appears; non-finite and whole-model events stay apart."""
    slots: dict[tuple[str, str, str, str], int] = {}  # group → its place in the output
    groups: list[list[AlertEvent]] = []
    for event in events:
        if event.rule == "nonfinite" or event.layer is None:
            groups.append([event])
            continue
        action = book.rule(event.rule, event.layer).action
        key = (event.rule, event.severity, action, str(event.silenced))
        if key not in slots:
            slots[key] = len(groups)
            groups.append([])
        groups[slots[key]].append(event)
    return [group[0] if len(group) == 1 else _merged(group, book.depth) for group in groups]


def _merged(group: list[AlertEvent], depth: dict[str, int]) -> AlertEvent:
    """The events of one rule at one step as one, led by the culprit: for ``dead``, the
    deepest dead layer whose next layer still gets gradient (where the flow stops); for
    ``jump``, the weak side of the largest break; otherwise the layer furthest past its
    threshold (per-layer overrides may set different ones)."""

    def past_threshold(event: AlertEvent) -> float:
        return event.value / event.threshold if event.threshold else event.value

    if group[0].rule == "dead":
        stops = [e for e in group if "The flow stops here" in e.message] or group
        worst = max(stops, key=lambda e: depth.get(e.layer or "", -1))
    else:
        worst = (min if group[0].rule == "vanishing" else max)(group, key=past_threshold)
    layers = tuple(e.layer for e in group if e.layer is not None)
    others = [name for name in layers if name != worst.layer]
    lead = "the culprit" if group[0].rule in ("dead", "jump") else "the worst"
    message = (
        f"{worst.rule} in {len(layers)} layers at once; {lead}: {worst.message} "
        f"The others: {listed(others)}."
    )
    return worst.model_copy(update={"layers": layers, "message": message})


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
        step=record.step,
        wall_time=record.wall_time,
        rule=rule or "skip",
        layer=None,
        statistic="total_norm",
        value=record.total_norm,
        threshold=None,
        severity=severity,
        rank=rank,
        message=f"step {record.step} tripped {rule} at its guard.{note}",
    )
    return [*events, fallback]
