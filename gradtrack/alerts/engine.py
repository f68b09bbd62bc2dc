"""`AlertEngine`: applies every alert rule to a step record, in one fixed order.

It composes the rule families (one module each) over the state they share: the rules as
they apply per layer (`RuleBook`), the cooldowns (`Cooldowns`), the layers' kinds and the
total norms seen so far; then merges the events of layers that tripped together.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

from gradtrack.alerts.amp import AmpCheck
from gradtrack.alerts.blame import BackwardOrder
from gradtrack.alerts.cooldown import Cooldowns
from gradtrack.alerts.dead import DeadCheck
from gradtrack.alerts.exploding import ExplodingCheck
from gradtrack.alerts.flow import FlowCheck
from gradtrack.alerts.jump import JumpCheck
from gradtrack.alerts.kinds import LayerKinds
from gradtrack.alerts.learning_rate import LearningRateCheck
from gradtrack.alerts.merge import merge_layers
from gradtrack.alerts.nonfinite import NonFiniteCheck
from gradtrack.alerts.rulebook import RuleBook
from gradtrack.alerts.skipped import told_skipped
from gradtrack.alerts.spikes import SpikeCheck
from gradtrack.alerts.story import Story
from gradtrack.alerts.update_ratio import UpdateRatioCheck
from gradtrack.alerts.vanishing import VanishingCheck
from gradtrack.alerts.wording import sentence
from gradtrack.config.rules import AlertRules
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord


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
        self._book = RuleBook(rules, depth_order)
        cooldowns = Cooldowns(self._book, rank)
        self._kinds = LayerKinds(
            kinds if kinds is not None else ["layer"] * len(depth_order), self._book.depth
        )
        self._backward = BackwardOrder(self._book.depth)
        self._total_norms: deque[float] = deque(maxlen=1000)
        self._amp = AmpCheck(self._book, cooldowns)
        self._nonfinite = NonFiniteCheck(self._book, cooldowns, self._backward)
        self._exploding = ExplodingCheck(self._book, cooldowns, self._total_norms)
        self._vanishing = VanishingCheck(self._book, cooldowns)
        self._dead = DeadCheck(self._book, cooldowns, saturating or [False] * len(depth_order))
        self._spike = SpikeCheck(self._book, cooldowns)
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
        if record.amp_skipped is not None:
            events += self._amp.check(record)
        if not record.amp_skipped:
            events += self._nonfinite.check(record)
        idx = self._book.positions(record)
        events += self._learning_rate.check(record, idx)  # a cause, before its consequences
        events += self._exploding.layers(record, idx)
        events += self._vanishing.check(record, idx) + self._dead.check(record, idx)
        events += self._exploding.check(record, None, record.total_norm)
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
