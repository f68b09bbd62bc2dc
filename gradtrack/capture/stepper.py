"""The end of one step on the training thread, in one direction: judge → plan, collect →
pending step, hand-off (waiting for the worker's answer where a raise rule judges the step).

Never waits on a sink; a raise or skip rule may cost one read of the device per step, and a
step a raise rule judges waits for the worker to have judged it.
"""

from __future__ import annotations

from gradtrack.capture.handover import Handover
from gradtrack.capture.probes import Probes
from gradtrack.capture.step_collect import StepCollector
from gradtrack.capture.verdict import StepJudge


class Stepper:
    """Ends steps: counts them, has each judged and planned, collects the ones the plan
    needs and hands them over."""

    def __init__(
        self, judge: StepJudge, collect: StepCollector, handover: Handover, probes: Probes
    ) -> None:
        self.step = 0
        self.ended = 0  # steps this watcher ended (``step`` may start past 0: a resumed run)
        self.judge = judge
        self.collect = collect
        self.handover = handover
        self.probes = probes

    def end(self) -> bool:
        """End step ``self.step``: guard it, judge it, summarise it if its plan needs it.
        True: a skip rule tripped, and the optimizer step is to be left out."""
        self.handover.release_held()
        step, self.step = self.step, self.step + 1
        self.ended += 1
        probes = self.probes
        if probes.accumulation is not None:
            probes.accumulation.backward()
        backward_order = probes.backward_order()
        micro_batches = probes.end_step()
        if self.judge.quiet(step):  # the common step: healthy, between logged ones
            if probes.origin is not None:
                probes.origin.forget()
            return False
        plan = self.judge.plan(step, micro_batches)
        if plan is None:
            return False
        origin = self.collect.origin_of(plan, probes)
        if probes.origin is not None:
            probes.origin.forget()  # the step's inputs and output gradient
        if not plan.needs_record:
            return False  # the common case: one pass over the gradients, nothing handed off
        self.judge.exact(plan)
        evidence = self.judge.evidence(plan)
        pending = self.collect.pending(plan, probes, backward_order, evidence, origin)
        self.handover.deliver(pending, plan)
        return plan.skip is not None

    def hand_on_last(self, outcome: str) -> None:
        """At close: the bad step latched after the last logged one, and the flight
        recorder's last steps where training ended in an exception or Ctrl-C."""
        last = self.collect.closing(self.step - 1, outcome, self.judge.read_latch)
        if last is not None:
            self.handover.put(last)

    def after_optimizer_step(self) -> None:
        self.handover.after_optimizer_step()

    def release_held(self) -> None:
        self.handover.release_held()
