"""The ``jump`` rule: gradient flow that breaks between two depths — every layer of a kind on
one side has a gradient RMS ``ratio`` below every layer of that kind on the other."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from gradtrack.alerts.check import Check
from gradtrack.alerts.cooldown import Cooldowns
from gradtrack.alerts.kinds import LayerKinds
from gradtrack.alerts.rulebook import RuleBook
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord


class Envelope(NamedTuple):
    """At each boundary between consecutive layers of one kind (depth order): the extremes of
    the RMS on either side, which side is weak, and by how much it is below the other."""

    above_max: np.ndarray  # layers nearer the input
    above_min: np.ndarray
    below_min: np.ndarray  # layers nearer the loss
    below_max: np.ndarray
    upstream_weak: np.ndarray  # else the side nearer the loss is the weak one
    weak: np.ndarray  # per boundary, the position of the weak side's layer next to it
    ratio: np.ndarray

    @classmethod
    def of(cls, values: np.ndarray) -> Envelope:
        """The envelope of the gradient RMS ``values`` of one kind's layers, in depth order."""
        above_max = np.maximum.accumulate(values)[:-1]
        above_min = np.minimum.accumulate(values)[:-1]
        below_min = np.minimum.accumulate(values[::-1])[::-1][1:]
        below_max = np.maximum.accumulate(values[::-1])[::-1][1:]
        starved, flooded = below_min / above_max, above_min / below_max
        upstream_weak = starved >= flooded
        boundary = np.arange(len(values) - 1)
        weak = np.where(upstream_weak, boundary, boundary + 1)
        ratio = np.maximum(starved, flooded)
        return cls(above_max, above_min, below_min, below_max, upstream_weak, weak, ratio)


class JumpCheck(Check):
    """Where every layer of a kind on one side of a depth is ``ratio`` below every layer
    of that kind on the other: an envelope, so that one layer that is small by nature
    (a query projection at initialisation) next to normal ones is no break."""

    def __init__(self, book: RuleBook, cooldowns: Cooldowns, kinds: LayerKinds) -> None:
        super().__init__(book, cooldowns)
        self.kinds = kinds

    def check(self, record: StepRecord) -> list[AlertEvent]:
        """The breaks of every kind of layer at this step."""
        rms = record.column("rms")
        events: list[AlertEvent] = []
        for kind, rows in self.kinds.comparable(record).items():
            events += self._breaks(record, kind, rows, Envelope.of(rms[rows]))
        return events

    def _breaks(
        self, record: StepRecord, kind: str, rows: np.ndarray, env: Envelope
    ) -> list[AlertEvent]:
        """The boundaries within one kind's ``rows`` past their layer's ``ratio``."""
        idx = self.book.at([record.layers[j] for j in rows[env.weak]])
        limit = self.book.param("jump", "ratio", idx)
        events: list[AlertEvent] = []
        for k in np.flatnonzero(self.book.enabled("jump", idx) & (env.ratio > limit)):
            up = bool(env.upstream_weak[k])
            strong = k + 1 if up else k
            a, b = record.layers[rows[env.weak[k]]], record.layers[rows[strong]]
            if up:
                low, high = env.above_max[k], env.below_min[k]
            else:
                low, high = env.below_max[k], env.above_min[k]
            side, other = ("up to", "from") if up else ("from", "up to")
            events += self.cooldowns.emit(
                record, "jump", a, statistic="rms_ratio", value=float(env.ratio[k]),
                threshold=float(limit[k]),
                message=(
                    f"gradient flow breaks between {a} and {b}: every {kind} layer {side} "
                    f"{a} has a gradient RMS of at most {low:.3g}, {env.ratio[k]:.3g}× below "
                    f"every {kind} layer {other} {b} (at least {high:.3g}). {a} is the weak "
                    "side. Look at what lies between them: a scale far from 1 (a tiny "
                    "constant, a near-zero initialisation), a saturating activation, a "
                    ".detach(), or a missing residual path or normalisation."
                ),
            )  # fmt: skip
        return events
