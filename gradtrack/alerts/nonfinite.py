"""The ``nonfinite`` rule: NaN or Inf in a step's gradient — where it was made, and why.

Its message tells apart an input batch, a forward pass, a loss and a backward pass that made
it, and weights that are already non-finite (an earlier bad update was applied), which no
batch can recover from.
"""

from __future__ import annotations

import numpy as np

from gradtrack.alerts.blame import BackwardOrder
from gradtrack.alerts.check import Check
from gradtrack.alerts.cooldown import Cooldowns
from gradtrack.alerts.diagnosis import nonfinite_diagnosis
from gradtrack.alerts.rulebook import RuleBook
from gradtrack.alerts.wording import counted, listed
from gradtrack.formats.event import AlertEvent, Stage
from gradtrack.formats.record import StepRecord
from gradtrack.handoff.trips import nonfinite_columns


class NonFiniteCheck(Check):
    """Remembers the last step with a non-finite gradient and the first with non-finite
    weights, so that a weights event can name the update that broke them."""

    def __init__(self, book: RuleBook, cooldowns: Cooldowns, blame: BackwardOrder) -> None:
        super().__init__(book, cooldowns)
        self.blame = blame
        self._last_bad_gradient: int | None = None  # the last step with a non-finite gradient
        self._weights_bad_since: int | None = None  # the first step whose weights were

    def check(self, record: StepRecord) -> list[AlertEvent]:
        """One event for every layer whose gradient holds NaN or Inf, named by its origin."""
        nan_counts, inf_counts = record.column("nan"), record.column("inf")
        norms = record.column("norm")  # exact: non-finite only where an element is
        rows = np.flatnonzero(nonfinite_columns(norms, nan_counts, inf_counts))
        if len(rows) == 0 or not self.book.rule("nonfinite", None).enabled:
            return []
        bad = [record.layers[j] for j in rows]
        origin, stage = self.blame.origin(record, bad)
        nan, inf = int(nan_counts[rows].sum()), int(inf_counts[rows].sum())
        kind = "NaN" if nan or np.isnan(norms[rows]).any() else "Inf"
        counts = _counts(record, bad, nan, inf, kind)
        message = self._message(record, kind, counts, origin, stage)
        if stage != "weights":
            self._last_bad_gradient = record.step
        return self.cooldowns.emit(
            record, "nonfinite", origin,
            statistic=("nan_count" if nan else "inf_count") if record.counted else "layers",
            value=float(nan or inf) if record.counted else float(len(bad)),
            threshold=0.0, message=message,
            origin_layer=origin, origin_stage=stage, ranks=record.nonfinite_ranks,
            layers=tuple(bad),
        )  # fmt: skip

    def _message(
        self, record: StepRecord, kind: str, counts: str, origin: str | None, stage: Stage
    ) -> str:
        if stage == "weights":
            return self._weights_message(record, kind, counts)
        where, advice = nonfinite_diagnosis(record, origin, stage)
        message = f"{kind} gradient {where}. {counts}. Try: {advice}."
        if record.origin_note and not record.origin_note.startswith("the input batch"):
            message += f" {record.origin_note[0].upper()}{record.origin_note[1:]}."
        return message

    def _weights_message(self, record: StepRecord, kind: str, counts: str) -> str:
        weights = record.nonfinite_weights or ()
        if self._weights_bad_since is None:
            self._weights_bad_since = record.step
        last = self._last_bad_gradient
        if last is not None and last < self._weights_bad_since:
            since = (
                f"since step {last + 1}: the update of step {last}, whose gradient was "
                "non-finite, was applied"
            )
            fix = f"fix what made step {last}'s gradient (its event says where)"
        else:
            since = f"since step {self._weights_bad_since} or earlier"
            fix = "find the first non-finite step (grad/nan_count, grad/inf_count)"
        return (
            f"{kind} gradient because the weights are non-finite: {listed(weights)} "
            f"({counted(len(weights), 'layer')}) hold NaN/Inf {since}. Every forward and backward "
            f"since is non-finite, whatever the batch: the run cannot recover by itself. "
            f"{counts}. Try: stop, restore a checkpoint from before that step, {fix}, and keep "
            "bad updates out of the weights: alerts={'nonfinite': {'action': 'raise'}}, "
            "gradient clipping, or a GradScaler (it skips non-finite steps)."
        )


def _counts(record: StepRecord, bad: list[str], nan: int, inf: int, kind: str) -> str:
    """How many elements, in which layers, and what activations and ranks add to that."""
    shown = listed(bad)
    elements = " and ".join(f"{n:,} {k}" for n, k in ((nan, "NaN"), (inf, "Inf")) if n)
    counts = f"{elements or kind} in {counted(len(bad), 'layer')}: {shown}"
    if not record.counted:
        counts = (
            f"{kind} in {counted(len(bad), 'layer')}: {shown} (elements not counted: "
            "a step between logged steps, latched on the accelerator)"
        )
    if record.activation_origin is not None:
        counts += (
            "; the first non-finite activation gradient was at the output of "
            f"{record.activation_origin}, so it arose in the backward of what follows it"
        )
    return counts + _ranks(record)


def _ranks(record: StepRecord) -> str:
    """Under DDP: on which ranks it arose before the all-reduce, if any."""
    ranks = record.nonfinite_ranks
    if ranks and record.nonfinite_rank_places:
        return (
            f"; it arose on rank(s) {', '.join(record.nonfinite_rank_places)}, whose model "
            "output or its gradient was non-finite — look at that batch"
        )
    if ranks:
        return (
            f"; before the all-reduce it was non-finite on rank(s) "
            f"{', '.join(map(str, ranks))} only — look at that rank's batch"
            if len(ranks) == 1
            else f"; before the all-reduce it was non-finite on ranks {list(ranks)}"
        )
    if ranks is not None:
        return "; every rank's local gradient was finite: the all-reduce overflowed"
    return ""
