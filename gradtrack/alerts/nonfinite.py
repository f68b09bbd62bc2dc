"""The rules on non-finite gradients: ``nonfinite`` (NaN or Inf in a step's gradient — where it
was made, and why) and ``amp`` (GradScaler overflow).

The ``nonfinite`` message tells apart an input batch, a forward pass, a loss and a backward
pass that made it, and weights that are already non-finite (an earlier bad update was
applied), which no batch can recover from. `BackwardOrder` says which layer, and which pass,
a step's non-finite gradient is blamed on: a replay (`gradtrack.capture.origin`) or the
weights check names it when it ran; otherwise the non-finite layer nearest the loss — the
first whose gradient became ready in backward. `nonfinite_diagnosis` words where it arose
and what to try for it.

``amp``: a step the GradScaler skipped is ``info``; ``max_skips`` in a row means the model
itself produces Inf/NaN, whatever the scale.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gradtrack.alerts.book import Check, Cooldowns, RuleBook, counted, listed
from gradtrack.formats.event import AlertEvent, Stage
from gradtrack.formats.record import StepRecord
from gradtrack.handoff.rules import PerStepRules


class NonFiniteCheck(Check):
    """Remembers the last step with a non-finite gradient and the first with non-finite
    weights, so that a weights event can name the update that broke them."""

    def __init__(
        self, book: RuleBook, cooldowns: Cooldowns, blame: BackwardOrder, per_step: PerStepRules
    ) -> None:
        super().__init__(book, cooldowns)
        self.blame = blame
        self.per_step = per_step
        self._last_bad_gradient: int | None = None  # the last step with a non-finite gradient
        self._weights_bad_since: int | None = None  # the first step whose weights were

    def check(self, record: StepRecord, idx: np.ndarray) -> list[AlertEvent]:
        """One event for every layer (``idx``: their positions in depth order) whose gradient
        holds NaN or Inf and whose rule is on, named by its origin."""
        nan_counts, inf_counts = record.column("nan"), record.column("inf")
        norms = record.column("norm")  # exact: non-finite only where an element is
        rows = self.per_step.nonfinite(idx + 1, norms, nan_counts, inf_counts).nonzero()[0]
        if len(rows) == 0:
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
            record,
            "nonfinite",
            origin,
            statistic=("nan_count" if nan else "inf_count") if record.counted else "layers",
            value=float(nan or inf) if record.counted else float(len(bad)),
            threshold=0.0,
            message=message,
            origin_layer=origin,
            origin_stage=stage,
            ranks=record.nonfinite_ranks,
            layers=tuple(bad),
        )

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


class BackwardOrder:
    """The order layers' gradients became ready in a backward pass, and what it blames."""

    def __init__(self, depth: dict[str, int]) -> None:
        self._depth = depth
        self._position: dict[str, int] = {}

    def set(self, layers: Sequence[str]) -> None:
        """Layers in the order their gradients became ready in a backward pass."""
        self._position = {name: i for i, name in enumerate(layers)}

    def origin(self, record: StepRecord, bad: list[str]) -> tuple[str | None, Stage]:
        """Where the non-finite gradient of ``record`` was made, of its ``bad`` layers."""
        if record.nonfinite_weights:
            return record.nonfinite_weights[0], "weights"
        if record.origin_module_stage in ("loss", "forward") and record.origin_module is None:
            return None, record.origin_module_stage  # type: ignore[return-value]
        if record.origin_module is not None and record.origin_module_stage is not None:
            return record.origin_module, record.origin_module_stage  # type: ignore[return-value]
        if record.output_finite is False:
            stage: Stage = "forward"
        elif record.output_grad_finite is False:
            stage = "loss"
        else:
            stage = "backward"
        if not bad or stage == "loss":  # no layer made it: the loss did
            return None, stage
        unknown = len(self._position)
        # Nearest the loss: first in backward order; never seen there → deepest in the model.
        origin = min(
            bad,
            key=lambda layer: (self._position.get(layer, unknown), -self._depth.get(layer, 0)),
        )
        return origin, stage


# The seed's fix column: an eps or a clamp on the op that made it, a GradScaler under fp16.
_FIX = (
    "an eps or a clamp where a log, sqrt or division meets 0 or a negative "
    "(torch.log(x.clamp_min(1e-8)), torch.sqrt(x + 1e-8), x / (y + 1e-8)), "
    "exp/pow overflow, and under fp16 AMP a GradScaler (or bf16)"
)


def nonfinite_diagnosis(record: StepRecord, origin: str | None, stage: Stage) -> tuple[str, str]:
    """Where it arose, and what to try; a ``"weights"`` stage has a message of its own
    (`NonFiniteCheck`)."""
    if stage == "forward" and record.origin_note.startswith("the input batch"):
        return (
            "from the input batch: it already held NaN/Inf (forward pass)",
            "check the data pipeline (missing values, a division in preprocessing): "
            "torch.isfinite(batch).all() where the batch is made",
        )
    if stage == "forward":
        made = f" at {origin}'s output" if record.origin_module else ""
        return (
            f"made in the forward pass{made} (the model output was already non-finite)",
            f"look at {origin}'s forward: {_FIX}; and the input batch for NaN/Inf"
            if record.origin_module
            else f"the input batch for NaN/Inf and the forward numerics: {_FIX}",
        )
    if stage == "loss":
        return (
            "made by the loss: the gradient reaching the model output was already non-finite",
            f"the loss produced it (log(0), division by zero, sqrt of 0, targets outside "
            f"the loss's range): {_FIX}; prefer fused losses (cross_entropy on logits, "
            "binary_cross_entropy_with_logits)",
        )
    return (
        f"first at {origin} (backward; model output finite)",
        f"look at the ops in {origin}'s backward: {_FIX}; then the learning rate (lower it, "
        "or clip the gradient norm)",
    )


class AmpCheck(Check):
    """Counts the steps in a row the GradScaler skipped."""

    def __init__(self, book: RuleBook, cooldowns: Cooldowns) -> None:
        super().__init__(book, cooldowns)
        self._skips = 0

    def check(self, record: StepRecord) -> list[AlertEvent]:
        """A step under a GradScaler (``record.amp_skipped`` is not None)."""
        rule = self.book.rule("amp", None)
        if not record.amp_skipped:
            self._skips = 0
            return []
        self._skips += 1
        if not rule.enabled:
            return []
        before, after = record.amp_scale, record.amp_scale_after
        change = f"scale {before:g}→{after:g}" if before is not None else "scale reduced"
        severity, message = "info", f"overflow: step skipped, {change}."  # the scaler's job
        if self._skips >= rule.max_skips:  # stuck: told at the rule's own severity
            severity = rule.severity
            message = (
                f"GradScaler skipped {counted(self._skips, 'step')} in a row ({change}): the "
                "gradients overflow whatever the scale. The model itself produces Inf/NaN: "
                "check the forward numerics, lower the learning rate, or train in bf16."
            )
        return self.cooldowns.emit(
            record,
            "amp",
            None,
            statistic="skipped_steps",
            value=float(self._skips),
            threshold=float(rule.max_skips),
            severity=severity,
            message=message,
        )
