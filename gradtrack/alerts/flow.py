"""The rules on gradient flow along depth, which compare layers of one kind with each other.

- ``jump``: gradient flow that breaks between two depths — every layer of a kind on one side
  has a gradient RMS ``ratio`` below every layer of that kind on the other.
- ``flow``: gradient that vanishes or explodes gradually along depth — the first layers of a
  role get far less (or more) gradient than its last, for ``patience`` steps.

`LayerKinds`: what each layer is compared with by these rules — its module type, or per
parameter its role (`gradtrack.capture.layers.layer_kinds`).
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from gradtrack.alerts.book import Check, Cooldowns, RuleBook, counted
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord
from gradtrack.handoff.layout import SPARSE_KINDS

_DIGITS = re.compile(r"\d+")


class LayerKinds:
    """The kind of each layer, in depth order (``depth``: layer name → position)."""

    def __init__(self, kinds: Sequence[str], depth: dict[str, int]) -> None:
        self._kinds = list(kinds)
        self._depth = depth
        # Asked by two rules of each step (`JumpCheck`, `FlowCheck`): the last answer, and
        # each layer's place in its repeated block, named once.
        self._last: tuple[StepRecord, dict[str, np.ndarray]] | None = None
        self._places: dict[str, str] = {}

    def of(self, layer: str | None) -> str | None:
        """The kind of ``layer`` (None: the whole model has none)."""
        return None if layer is None else self._kinds[self._depth[layer]]

    def comparable(self, record: StepRecord) -> dict[str, np.ndarray]:
        """Rows (depth order) with a finite, non-zero gradient RMS, per kind of layer; layers
        with row-sparse gradients (embeddings) are compared with nothing."""
        last = self._last
        if last is not None and last[0] is record:
            return last[1]
        rms = record.column("rms")
        by_kind: dict[str, list[int]] = {}
        for j in (np.isfinite(rms) & (rms > 0)).nonzero()[0].tolist():
            kind = self._kinds[self._depth[record.layers[j]]]
            if kind not in SPARSE_KINDS:
                by_kind.setdefault(kind, []).append(j)
        rows = {kind: np.array(rows) for kind, rows in by_kind.items() if len(rows) > 1}
        self._last = (record, rows)
        return rows

    def place(self, layer: str) -> str:
        """``layer``'s place in a repeated block: its name with each number as ``#``
        (``blocks.3.attn.q`` → ``blocks.#.attn.q``)."""
        place = self._places.get(layer)
        if place is None:
            place = self._places[layer] = _DIGITS.sub("#", layer)
        return place


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
        self._everyone = np.arange(len(book.names))
        self._least: float | None = None

    def check(self, record: StepRecord) -> list[AlertEvent]:
        """The breaks of every kind of layer at this step."""
        rms = record.column("rms")
        if self._least is None:  # the smallest ratio any layer's rule asks (looked up per
            # layer: at the first step in the worker, not in watch() on the training thread)
            self._least = float(self.book.param("jump", "ratio", self._everyone).min())
        events: list[AlertEvent] = []
        for kind, rows in self.kinds.comparable(record).items():
            values = rms[rows]
            if values.max() <= self._least * values.min():
                continue  # no boundary within this kind can be past its ratio
            events += self._breaks(record, kind, rows, Envelope.of(values))
        return events

    def _breaks(
        self, record: StepRecord, kind: str, rows: np.ndarray, env: Envelope
    ) -> list[AlertEvent]:
        """The boundaries within one kind's ``rows`` past their layer's ``ratio``."""
        idx = self.book.at([record.layers[j] for j in rows[env.weak]])
        limit = self.book.param("jump", "ratio", idx)
        events: list[AlertEvent] = []
        for k in (self.book.enabled("jump", idx) & (env.ratio > limit)).nonzero()[0]:
            up = bool(env.upstream_weak[k])
            strong = k + 1 if up else k
            a, b = record.layers[rows[env.weak[k]]], record.layers[rows[strong]]
            if up:
                low, high = env.above_max[k], env.below_min[k]
            else:
                low, high = env.below_max[k], env.above_min[k]
            side, other = ("up to", "from") if up else ("from", "up to")
            events += self.cooldowns.emit(
                record,
                "jump",
                a,
                statistic="rms_ratio",
                value=float(env.ratio[k]),
                threshold=float(limit[k]),
                message=(
                    f"gradient flow breaks between {a} and {b}: every {kind} layer {side} "
                    f"{a} has a gradient RMS of at most {low:.3g}, {env.ratio[k]:.3g}× below "
                    f"every {kind} layer {other} {b} (at least {high:.3g}). {a} is the weak "
                    "side. Look at what lies between them: a scale far from 1 (a tiny "
                    "constant, a near-zero initialisation), a saturating activation, a "
                    ".detach(), or a missing residual path or normalisation."
                ),
            )
        return events


class FlowCheck(Check):
    """The seed's profile, first layers over last, compared like with like: per *role* —
    a kind of layer at one place in a repeated block (``blocks.#.attn.q``; every layer of
    a plain stack) with at least 3 layers — the geometric-mean gradient RMS of its first
    quarter over its last quarter; the model's ratio is the median role's. Query and key
    projections, small by nature, are so compared only with each other."""

    def __init__(
        self, book: RuleBook, cooldowns: Cooldowns, kinds: LayerKinds, total_norms: deque[float]
    ) -> None:
        super().__init__(book, cooldowns)
        self.kinds = kinds
        self.total_norms = total_norms  # the finite total norms so far, for a clipping norm
        self._run = 0  # logged steps in a row the rule tripped, signed by direction

    def check(self, record: StepRecord, broken: set[str | None]) -> list[AlertEvent]:
        """``broken``: the kinds the jump rule found a break in at this step (its finding)."""
        rule = self.book.rule("flow", None)
        comparable = self.kinds.comparable(record)
        if not rule.enabled or not comparable:
            return []
        median = _median_role(record, comparable, self.kinds)
        if median is None:
            self._run = 0
            return []
        log_ratio, kind, rows = median
        ratio = float(np.exp(log_ratio))
        direction = -1 if ratio < 1 / rule.ratio else 1 if ratio > rule.ratio else 0
        if direction == 0 or kind in broken:  # a break is the jump rule's finding
            self._run = 0
            return []
        same = self._run * direction > 0
        self._run = self._run + direction if same else direction
        if abs(self._run) < rule.patience:
            return []
        names = [record.layers[j] for j in rows]  # first: the starving (or flooded) end
        return self.cooldowns.emit(
            record,
            "flow",
            names[0],
            statistic="flow_ratio",
            value=ratio,
            threshold=1 / rule.ratio if direction < 0 else rule.ratio,
            message=self._message(kind, names, ratio, direction),
        )

    def _message(self, kind: str, names: list[str], ratio: float, direction: int) -> str:
        quarter = max(1, len(names) // 4)
        first_names, last_names = ", ".join(names[:quarter]), ", ".join(names[-quarter:])
        decades = abs(math.log10(ratio))
        span = f"across {len(names)} {kind} layers, {decades:.1f} decades"
        if direction < 0:
            return (
                f"gradient vanishes along depth: the first {kind} layers ({first_names}) get "
                f"{ratio:.3g}× the gradient RMS of the last ones ({last_names}) — {span} lost "
                f"gradually, for {counted(abs(self._run), 'logged step')}: the first layers barely "
                "learn. Try: non-saturating activations (ReLU/GELU instead of sigmoid/tanh), "
                "residual connections, normalisation (LayerNorm/BatchNorm), and a "
                "variance-preserving initialisation (Kaiming for ReLU, Xavier for tanh)."
            )
        history = list(self.total_norms)
        clip = float(np.percentile(history, 50)) if history else 1.0
        return (
            f"gradient explodes along depth: the first {kind} layers ({first_names}) get "
            f"{ratio:.3g}× the gradient RMS of the last ones ({last_names}) — {span} "
            f"gained, for {counted(abs(self._run), 'logged step')}. Try: clipping, "
            f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={clip:.2g}) (the "
            "median total norm so far), a lower learning rate, normalisation "
            "(LayerNorm/BatchNorm), or a smaller initialisation."
        )


def _median_role(
    record: StepRecord, comparable: dict[str, np.ndarray], kinds: LayerKinds
) -> tuple[float, str, list[int]] | None:
    """The median role's log ratio of first to last quarter, its kind and rows (depth order);
    None if no role has 3 layers."""
    rms = record.column("rms")
    roles: dict[tuple[str, str], list[int]] = {}
    for kind, kind_rows in comparable.items():
        for j in kind_rows.tolist():
            roles.setdefault((kind, kinds.place(record.layers[j])), []).append(j)
    profiles = []  # (log ratio, kind, rows in depth order)
    for (kind, _), role_rows in roles.items():
        if len(role_rows) >= 3:
            quarter = max(1, len(role_rows) // 4)
            head, tail = rms[role_rows[:quarter]], rms[role_rows[-quarter:]]
            profiles.append((np.log(head).mean() - np.log(tail).mean(), kind, role_rows))
    if not profiles:
        return None
    profiles.sort(key=lambda profile: profile[0])
    return profiles[(len(profiles) - 1) // 2]  # the median role
