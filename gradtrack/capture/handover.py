"""A planned step collected and handed to the worker.

`StepCollector`: the `PendingStep` the worker gets — its reductions and host copy launched
(`gradtrack.capture.collect`), its evidence attached, and, for a non-finite step, where it was
made (`gradtrack.capture.origin`). `Handover`: through the mailbox, after the optimizer step
where update signals are asked for (`gradtrack.capture.updates`), and — for a step a raise
rule judges — waiting for the worker's answer, agreed by every rank, before its optimizer
step runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from gradtrack.capture.collect import Collector
from gradtrack.capture.distributed import RankGroup
from gradtrack.capture.flight_ring import FlightRecorder
from gradtrack.capture.origin import nonfinite_weight_layers
from gradtrack.capture.probes import Probes
from gradtrack.capture.updates import SampledUpdateProbe, UpdateProbe, WholeUpdateProbe
from gradtrack.capture.verdict import EvidenceParts, StepPlan
from gradtrack.errors import GradientAlertError
from gradtrack.formats.event import AlertEvent
from gradtrack.handoff.mailbox import Mailbox, PendingStep, Reply, UpdateFollowUp

OnError = Callable[[int, Exception], None]


class Handover:
    """The training thread's side of the mailbox. ``wait_s``: how long a step a raise rule
    judges waits for the worker's answer (a worker far behind, or stopped, is not waited for
    past it: the step's own trip then raises)."""

    def __init__(
        self,
        mailbox: Mailbox,
        updates: UpdateProbe | SampledUpdateProbe | WholeUpdateProbe | None,
        ranks: RankGroup | None,
        wait_s: float,
        on_error: OnError,
    ) -> None:
        self.mailbox = mailbox
        self.updates = updates
        self.ranks = ranks
        self.wait_s = wait_s
        self._on_error = on_error
        # A logged step waiting for its optimizer step, to carry the update it applied; or
        # the step (judged, so handed already) whose update follows it.
        self._held: PendingStep | None = None
        self._follows: int | None = None

    def put(self, item: PendingStep | UpdateFollowUp) -> None:
        self.mailbox.put_step(item)

    def deliver(self, pending: PendingStep | None, plan: StepPlan) -> None:
        """Hand the step on; for a step a raise rule judges, wait for the worker's verdict
        and raise it here (every rank together)."""
        error = plan.error
        if not plan.judge_now:
            if pending is not None:
                self._hand_on(pending, plan)
        else:
            error = self._judged(pending, plan) or error
            if self.ranks is not None:
                error = self._agreed(error)
        if error is not None:
            raise error

    def _judged(self, pending: PendingStep | None, plan: StepPlan) -> GradientAlertError | None:
        trip = plan.verdict.trip
        if pending is None:  # another rank's worker judges (or collecting failed)
            return None if trip is None else _unjudged(plan, "no record of it could be made")
        reply = pending.reply = Reply()
        pending.expects_update = self._wants_update(plan)
        self.put(pending)
        judged = reply.wait(self.wait_s, lambda: self.mailbox.closed)
        if pending.expects_update:
            self._follow(plan.step, run=judged and reply.event is None)
        if judged:
            return None if reply.event is None else GradientAlertError(reply.event)
        if trip is None:
            return None
        return _unjudged(plan, f"gradtrack's worker did not judge it within {self.wait_s:g} s")

    def _agreed(self, error: GradientAlertError | None) -> GradientAlertError | None:
        """Every rank stops together, with the first rank's event, or the others would wait
        in their next collective."""
        assert self.ranks is not None
        event = None if error is None else error.event
        shared = self.ranks.broadcast_from_first(
            None if event is None else event.model_dump_json()  # type: ignore[attr-defined]
        )
        if shared is None:
            return None
        return GradientAlertError(AlertEvent.model_validate_json(shared))

    # -- update signals: a logged step's update, measured around its optimizer step --------
    def _wants_update(self, plan: StepPlan) -> bool:
        return self.updates is not None and plan.logged and plan.skip is None

    def _measuring(self, step: int) -> bool:
        """Start measuring the update the coming optimizer step applies; False if that failed
        (reported)."""
        try:
            assert self.updates is not None
            self.updates.before()
            return True
        except Exception as exc:  # watching must never crash training
            self._on_error(step, exc)
            return False

    def _hand_on(self, pending: PendingStep, plan: StepPlan) -> None:
        if self._wants_update(plan) and self._measuring(plan.step):
            self._held = pending
        else:
            self.put(pending)

    def _follow(self, step: int, run: bool) -> None:
        """A judged step's update follows it once its optimizer step ran (``run``)."""
        if run and self._measuring(step):
            self._follows = step
        else:
            self.put(UpdateFollowUp(step))

    def after_optimizer_step(self, *_hook_args: Any) -> None:
        """The update a held logged step applied: measured, attached, handed on (the
        optimizer's step post-hook, called at every step)."""
        if self._held is None and self._follows is None:
            return
        held, self._held = self._held, None
        follows, self._follows = self._follows, None
        if self.updates is None:
            return
        step = held.step if held is not None else follows
        update = None
        try:
            update = self.updates.after()
        except Exception as exc:  # watching must never crash training
            self._on_error(step or 0, exc)
        if held is not None:
            held.update = update
            self.put(held)
        elif follows is not None:
            self.put(UpdateFollowUp(follows, update))

    def release_held(self) -> None:
        """A held step whose optimizer step did not come (skipped, or it raised)."""
        held, self._held = self._held, None
        follows, self._follows = self._follows, None
        if held is not None:
            self.put(held)
        if follows is not None:
            self.put(UpdateFollowUp(follows))


def _unjudged(plan: StepPlan, why: str) -> GradientAlertError:
    """The error of a per-step rule that tripped on the step's norms, where the worker could
    not judge the step: the event names the rule and the layer, from the norms alone."""
    assert plan.verdict.trip is not None
    rule, layer = plan.verdict.trip
    name = layer or "the total gradient"
    return GradientAlertError(
        AlertEvent(
            step=plan.step,
            wall_time=time.time(),
            rule=rule,
            layer=layer,
            statistic="norm" if layer else "total_norm",
            value=float("nan"),
            threshold=0.0,
            severity="error",
            layers=(layer,) if layer else (),
            message=(
                f"{rule} at step {plan.step} in {name} (action='raise'); {why}, so this "
                "event holds only what the step's norms say (the worker's own event, once it "
                "judges the step, goes to the run's alerts)."
            ),
        )
    )


class StepCollector:
    """Collects planned steps on this rank; rank 0 (or the one process) hands them on."""

    def __init__(
        self,
        collector: Collector,
        ranks: RankGroup | None,
        flight: FlightRecorder | None,
        on_error: OnError,
    ) -> None:
        self.collector = collector
        self.ranks = ranks
        self.flight = flight
        self._on_error = on_error

    def origin_of(self, plan: StepPlan, probes: Probes) -> dict[str, Any] | None:
        """Where a non-finite step came from, where it is summarised or judged now: are the
        weights already non-finite (an earlier bad update was applied)? If not, and the step
        is the first bad one of its window, judged now or skipped, which module made it (a
        replay of its forward and backward)."""
        replay = plan.first_bad or plan.judge_now or plan.skip is not None
        if not plan.bad or not (plan.due or replay):
            return None
        try:
            collector = self.collector
            weights = nonfinite_weight_layers(
                collector.index.layer_names, collector.params, collector.index.tensor_layer
            )
            fields: dict[str, Any] = {"nonfinite_weights": weights}
            found = probes.locate() if not weights and replay else None
            if found is not None:
                fields.update(
                    origin_module=found.module,
                    origin_module_stage=found.stage,
                    origin_note=found.note,
                )
            return fields
        except Exception as exc:  # watching must never crash training
            self._on_error(plan.step, exc)
            return None

    def pending(
        self,
        plan: StepPlan,
        probes: Probes,
        backward_order: list[int] | None,
        evidence_parts: EvidenceParts,
        origin: dict[str, Any] | None,
    ) -> PendingStep | None:
        """Launch the step's reductions and its copy to the host; None if this rank hands
        nothing to a worker (another rank writes, or collecting failed). Max and mean |g| are
        computed only on ``plan.per_layer`` steps: they cost two more passes over every
        gradient. The replicated ranks' local norms are gathered on due steps only (the probe
        takes them then; every rank agrees on a bad step, whose gradients are all-reduced)."""
        ranks = self.ranks
        try:
            rank_norms = None
            if probes.local is not None and ranks is not None and plan.due:
                # The step's one collective: every replicated rank's local norms, to rank 0.
                local = probes.local.take(self.collector.params[0].device)
                rank_norms = ranks.all_gather(local).reshape(-1)
            if ranks is not None and ranks.rank != 0 and ranks.layout != "sharded":
                return None
            evidence, activation_order = probes.evidence()
            evidence.rank_norms = rank_norms
            evidence.spike, evidence.latch = evidence_parts
            if self.flight is not None:
                evidence.flight = self.flight.take()
            parts = self.collector.collect(
                plan.guard, plan.with_samples, evidence, full=plan.per_layer
            )
        except Exception as exc:  # watching must never crash training
            self._on_error(plan.step, exc)
            return None
        if not parts or (ranks is not None and ranks.rank != 0):
            return None  # (sharded: this rank's shard rows went into rank 0's)
        return PendingStep(
            plan.step,
            time.time(),
            parts,
            backward_order,
            activation_order,
            per_layer=plan.per_layer,
            origin=origin,
            skipped_by=None if plan.skip is None else plan.skip.rule,
            skipped_steps=plan.skipped_steps,
            batch=probes.batch,
        )

    def closing(
        self, step: int, outcome: str, read_latch: Callable[[], np.ndarray | None]
    ) -> PendingStep | None:
        """At close (a read of the device): the bad step latched after the last logged one,
        and the recorder's last steps where training ended in an exception or Ctrl-C."""
        if self.ranks is not None and self.ranks.rank != 0:
            return None
        try:
            latch, flight = read_latch(), self.flight
            if latch is not None and self.ranks is not None and self.ranks.layout == "sharded":
                # Rank 0's own pieces only (no collective at close): what it knows for sure
                # is which tensors went non-finite, not the others' full norms.
                n = len(self.collector.params)
                norms = latch[1 : 1 + n]
                latch[1 : 1 + n] = np.where(np.isfinite(norms), -1.0, norms)
            ending = None if outcome == "FINISHED" else outcome
            if latch is None and (ending is None or flight is None):
                return None
            last = PendingStep(step, time.time(), [], ending=ending, latch=latch)
            last.flight_rows = None if flight is None else flight.take_on_host()
            return last
        except Exception as exc:  # watching must never crash training
            self._on_error(step, exc)
            return None
