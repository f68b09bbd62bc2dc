"""The end of one step on the training thread, in one direction: judge → plan, collect →
pending step, hand-off (waiting for the worker's answer where a raise rule judges the step).

The hooks that end a step (`gradtrack.capture.probes`) call the `Stepper` directly:
``boundary`` at the optimizer's step, the scaler's update or the end of backward, ``end``
from a skip rule's gate. `step_path` builds the stepper and its parts from a watch's config.

Never waits on a sink; a raise or skip rule may cost one read of the device per step, and a
step a raise rule judges waits for the worker to have judged it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradtrack.capture.collect import Collector
from gradtrack.capture.distributed import RankGroup, replicated
from gradtrack.capture.handover import Handover, OnError, StepCollector
from gradtrack.capture.probes import Probes, StepSource
from gradtrack.capture.verdict import StepJudge, StepSchedule, build_signals
from gradtrack.config import GradtrackConfig, NoiseScaleOptions
from gradtrack.config.rules import SKIPPABLE
from gradtrack.handoff.mailbox import Mailbox
from gradtrack.handoff.rules import PerStepRules, StepRules


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

    def attach(
        self,
        model: nn.Module,
        params: list[nn.Parameter],
        optimizer: torch.optim.Optimizer | None,
        scaler: torch.amp.GradScaler | None,
        steps: StepSource,
        outputs: list[nn.Module],
        ranks: RankGroup | None,
        noise_scale: NoiseScaleOptions,
    ) -> None:
        """Every hook of the watch: those that end a step (and call this stepper), the update
        signals' after the optimizer step, and the probes gathering evidence."""
        probes, signals, collector = self.probes, self.judge.signals, self.collect.collector
        skipping = signals.skips is not None
        distributed = ranks is not None
        probes.attach_step_source(
            model, params, optimizer, scaler, steps, skipping, self, distributed
        )
        if signals.updates is not None and optimizer is not None:
            hook = self.handover.after_optimizer_step
            probes.handles.append(optimizer.register_step_post_hook(hook))
        probes.attach_evidence(model, collector, ranks, outputs, self.next_is_due)
        probes.attach_noise_scale(model, collector, ranks, noise_scale)

    def boundary(self, *_hook_args: Any) -> None:
        """A step's gradients are complete (the optimizer is about to step, the scaler
        updates, a backward ended, or the owner said so): end the step; where a skip rule
        gates the optimizer, the gate holds the verdict."""
        skip = self.end()
        if self.probes.gate is not None:  # (steps ended by hand or at backward)
            self.probes.gate.held = skip

    def next_is_due(self) -> bool:
        """Whether the step about to run is logged or sampled (the evidence probes ask)."""
        return self.judge.schedule.any_due(self.step)

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
        plan = self.judge.quiet_logged(step) or self.judge.plan(step, micro_batches)
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

    def release_held(self) -> None:
        self.handover.release_held()


def step_path(
    config: GradtrackConfig,
    per_step: PerStepRules,
    collector: Collector,
    ranks: RankGroup | None,
    mailbox: Mailbox,
    stepped: bool,
    scaled: bool,
    on_error: OnError,
) -> Stepper:
    """The parts a step passes through on the training thread, from its verdict to the
    mailbox, judged by ``per_step``, the rules the worker's alerts share. ``stepped``: an
    optimizer steps once per step; ``scaled``: a GradScaler's update ends each step;
    ``on_error`` hears of a step that could not be collected."""
    # The guard's verdict is read at every step unless each rank sees only its shards
    # (FSDP2): unlogged steps would need a collective, so the logged steps judge.
    every_step = ranks is None or replicated(ranks)
    signals = build_signals(config, per_step, collector, stepped and not scaled, every_step, scaled)
    raising = config.alerts.with_action("raise")
    # A raise rule the step's norms cannot judge has the worker judge every due step.
    judge_due = bool(set(raising) - set(SKIPPABLE)) or (bool(raising) and not every_step)
    raises = StepRules(per_step, "raise")
    schedule = StepSchedule(config)
    judge = StepJudge(collector, signals, schedule, raises, judge_due, every_step, on_error)
    collect = StepCollector(collector, ranks, signals.flight, on_error)
    handover = Handover(mailbox, signals.updates, ranks, config.flush_timeout_s, on_error)
    return Stepper(judge, collect, handover, Probes())
