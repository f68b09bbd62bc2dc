"""The end of one step on the training thread, in one direction: guard → verdict → (if the
step is due, bad or skipped) summarise → judge now (a raise rule) → hand to the worker.

Never waits on a sink; a raise or skip rule may cost one read of the device per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gradtrack.capture.collect import Collector, Guard
from gradtrack.capture.distributed import RankGroup
from gradtrack.capture.origin import nonfinite_weight_layers
from gradtrack.capture.probes import Probes
from gradtrack.capture.schedule import StepSchedule
from gradtrack.capture.skip import Skip
from gradtrack.capture.step_signals import Signals
from gradtrack.capture.verdict import StepJudge, Verdict
from gradtrack.errors import GradientAlertError
from gradtrack.formats.event import AlertEvent
from gradtrack.handoff.mailbox import Mailbox
from gradtrack.handoff.pending import AssembledStep, PendingStep

OnError = Callable[[int, Exception], None]
# A raise rule's judgement now, in this thread: the step's record and alerts, and the error
# one of them raises.
JudgeNow = Callable[[PendingStep], tuple[AssembledStep, GradientAlertError | None]]


@dataclass
class StepPlan:
    """What one step turned out to need, from its schedule and its verdict."""

    step: int
    logged: bool
    with_samples: bool
    verdict: Verdict
    spike: torch.Tensor | None
    error: GradientAlertError | None  # a skip rule that escalated (max_consecutive)
    first_bad: bool  # the first non-finite step of its ``layer_every`` window
    first_flagged: bool  # that, or the first spiking step of its window

    @property
    def skip(self) -> Skip | None:
        return self.verdict.skip

    @property
    def bad(self) -> bool:
        return not self.verdict.finite

    @property
    def due(self) -> bool:
        return self.logged or self.with_samples

    def needs_record(self, raise_on_alert: bool) -> bool:
        """Summarised: a due step, the first flagged one of its window, a skipped one, or a
        flagged one a raise rule (or an escalated skip) must judge now."""
        flagged = self.bad or self.verdict.spiking
        judged = flagged and (raise_on_alert or self.error is not None)
        return self.due or self.first_flagged or self.skip is not None or judged


class Stepper:
    """Ends steps: counts them, guards and judges each, summarises the due and the bad ones
    and hands them to the worker's mailbox; a logged step waits for its optimizer step where
    update signals are asked for."""

    def __init__(
        self,
        collector: Collector,
        schedule: StepSchedule,
        judge: StepJudge,
        signals: Signals,
        probes: Probes,
        judge_now: JudgeNow,
        mailbox: Mailbox,
        ranks: RankGroup | None,
        on_error: OnError,
    ) -> None:
        self.step = 0
        self.collector = collector
        self.schedule = schedule
        self.judge = judge
        self.signals = signals
        self.probes = probes
        self.judge_now = judge_now
        self.mailbox = mailbox
        self.ranks = ranks
        self.raise_on_alert = judge.raise_on_alert
        self._on_error = on_error
        # A logged step waiting for its optimizer step, to carry the update it applied.
        self._held: PendingStep | AssembledStep | None = None

    def end(self) -> bool:
        """End step ``self.step``: guard it, judge it, summarise it if due. True: a skip rule
        tripped, and the optimizer step is to be left out."""
        self.release_held()
        step, self.step = self.step, self.step + 1
        if self.probes.accumulation is not None:
            self.probes.accumulation.backward()
        backward_order = self.probes.backward_order()
        micro_batches = self.probes.end_step()
        logged, with_samples = self.schedule.due(step)
        guard = self.judge.guard(step, exact=logged or with_samples)
        if guard is None:
            return False
        plan = self._plan(step, logged, with_samples, guard, micro_batches)
        if self.signals.flight is not None:  # one copy on the device
            self.signals.flight.record(
                step, self.judge.layer_norms, self._on_error, self.judge.holding()
            )
        origin = self._origin_of(plan)
        if self.probes.origin is not None:
            self.probes.origin.forget()  # the step's inputs and output gradient
        if not plan.needs_record(self.raise_on_alert):
            return False  # the common case: one pass over the gradients, nothing handed off
        if not guard.exact:  # a bad or skipped step is summarised: its norms must be exact
            guard = self.judge.guard(step, exact=True) or guard
        per_layer = (plan.due and self.schedule.per_layer(step)) or plan.first_flagged
        pending = self._collect(guard, plan, backward_order, per_layer)
        if pending is not None:
            pending.origin = origin
            pending.skipped_by = None if plan.skip is None else plan.skip.rule
            pending.skipped_steps = 0 if self.signals.skips is None else self.signals.skips.total
        self._deliver(pending, plan)
        return plan.skip is not None

    def _plan(
        self, step: int, logged: bool, with_samples: bool, guard: Guard, micro_batches: list[int]
    ) -> StepPlan:
        verdict, spike = self.judge.judge(guard, step)
        error = None
        skips = self.signals.skips
        if verdict.skip is not None and skips is not None:
            error = skips.count(step, verdict.skip)
            if error is None:
                self._write_journal(step, verdict.skip, micro_batches)
            else:
                verdict = verdict._replace(skip=None)
        bad = not verdict.finite
        first_bad = bad and self.schedule.first_bad(step)
        spiked = verdict.spiking and not bad and self.schedule.first_spike(step)
        return StepPlan(
            step, logged, with_samples, verdict, spike, error, first_bad, first_bad or spiked
        )

    def _origin_of(self, plan: StepPlan) -> dict[str, Any] | None:
        """Where a non-finite step came from, where it is summarised or judged now."""
        replay = plan.first_bad or self.raise_on_alert or plan.skip is not None
        if plan.bad and (plan.due or replay):
            return self._origin(plan.step, replay=replay)
        return None

    def _deliver(self, pending: PendingStep | None, plan: StepPlan) -> None:
        """Hand the step on; with a raise rule, judge it first and raise in this thread (every
        rank together)."""
        error = plan.error
        if not self.raise_on_alert:
            if pending is not None:
                self._hand_on(pending, plan)
            if error is not None:
                raise error
            return
        error = self._evaluate_now(pending, plan) or error
        if self.ranks is not None:
            # Every rank stops together, or the others would wait in their next collective.
            event = None if error is None else error.event
            shared = self.ranks.broadcast_from_first(
                None if event is None else event.model_dump_json()  # type: ignore[attr-defined]
            )
            if error is None and shared is not None:
                error = GradientAlertError(AlertEvent.model_validate_json(shared))
        if error is not None:
            raise error

    def _collect(
        self,
        guard: Guard,
        plan: StepPlan,
        backward_order: list[int] | None,
        per_layer: bool,
    ) -> PendingStep | None:
        """Launch the step's reductions and its copy to the host; None if this rank hands
        nothing to a worker (another rank writes, or collecting failed). Max and mean |g| are
        computed only on ``per_layer`` steps: they cost two more passes over every gradient.
        The replicated ranks' local norms are gathered on due steps only (the probe takes
        them then; every rank agrees on a bad step, whose gradients are all-reduced)."""
        ranks, probes = self.ranks, self.probes
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
            evidence.spike = self.judge.spike_or_unknown(guard, plan.spike)
            evidence.latch = self.judge.take_latch(guard)
            if self.signals.flight is not None:
                evidence.flight = self.signals.flight.take()
            parts = self.collector.collect(guard, plan.with_samples, evidence, full=per_layer)
        except Exception as exc:  # watching must never crash training
            self._on_error(plan.step, exc)
            return None
        if not parts or (ranks is not None and ranks.rank != 0):
            return None  # (sharded: this rank's shard rows went into rank 0's)
        return PendingStep(
            plan.step, time.time(), parts, backward_order, activation_order, per_layer=per_layer,
            batch=self.probes.batch,
        )  # fmt: skip

    def hand_on_last(self, outcome: str) -> None:
        """At close (a read of the device): the bad step latched after the last logged one,
        and the recorder's last steps where training ended in an exception or Ctrl-C."""
        if self.ranks is not None and self.ranks.rank != 0:
            return
        try:
            latch, flight = self.judge.read_latch(), self.signals.flight
            ending = None if outcome == "FINISHED" else outcome
            if latch is not None or (ending is not None and flight is not None):
                last = PendingStep(self.step - 1, time.time(), [], ending=ending, latch=latch)
                last.flight_rows = None if flight is None else flight.take_on_host()
                self.mailbox.put_step(last)
        except Exception as exc:  # watching must never crash training
            self._on_error(self.step - 1, exc)

    def _evaluate_now(
        self, pending: PendingStep | None, plan: StepPlan
    ) -> GradientAlertError | None:
        """A "raise" rule must see the step before the optimizer applies it: the record is
        made and judged here (one wait for the device's copy), then handed to the worker."""
        if pending is None:
            return None
        assembled, error = self.judge_now(pending)
        self._hand_on(assembled, plan)
        return error

    def _origin(self, step: int, replay: bool) -> dict[str, Any] | None:
        """A non-finite step, before its update: are the weights already non-finite (an
        earlier bad update was applied)? If not, and ``replay``, which module made it."""
        try:
            collector, probe = self.collector, self.probes.origin
            weights = nonfinite_weight_layers(
                collector.index.layer_names, collector.params, collector.index.tensor_layer
            )
            fields: dict[str, Any] = {"nonfinite_weights": weights}
            if not weights and replay and probe is not None:
                found = probe.locate()
                fields.update(
                    origin_module=found.module,
                    origin_module_stage=found.stage,
                    origin_note=found.note,
                )
            return fields
        except Exception as exc:  # watching must never crash training
            self._on_error(step, exc)
            return None

    def _write_journal(self, step: int, skip: Skip, micro_batches: list[int]) -> None:
        journal = self.signals.journal
        if journal is None:
            return
        try:
            journal.add(step, skip, micro_batches)
        except OSError as exc:  # the step is still skipped; only its journal line is lost
            self._on_error(step, exc)

    # -- update signals: a logged step waits for its optimizer step -----------------------
    def _hand_on(self, item: PendingStep | AssembledStep, plan: StepPlan) -> None:
        updates = self.signals.updates
        if updates is not None and plan.logged and plan.skip is None:
            try:
                updates.before()
                self._held = item
                return
            except Exception as exc:  # watching must never crash training
                self._on_error(plan.step, exc)
        self.mailbox.put_step(item)

    def after_optimizer_step(self) -> None:
        """The update a held logged step applied: measured, attached, handed on."""
        held, self._held = self._held, None
        updates = self.signals.updates
        if held is None or updates is None:
            return
        try:
            update = updates.after()
            held.update = update  # (a judged step's record gets it on the worker)
        except Exception as exc:  # watching must never crash training
            self._on_error(self.step - 1, exc)
        self.mailbox.put_step(held)

    def release_held(self) -> None:
        """A held step whose optimizer step did not come (skipped, or it raised)."""
        held, self._held = self._held, None
        if held is not None:
            self.mailbox.put_step(held)
