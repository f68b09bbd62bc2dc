"""The worker thread: takes batches of steps from the mailbox, builds their records and alerts
(`gradtrack.worker.assemble`), does what each alert asks (`AlertActions`), answers a judged
step's `Reply`, and hands records and alerts to delivery's `Outbox` (`gradtrack.delivery.courier`).

Between the training thread and the worker sits a bounded mailbox (`gradtrack.handoff.mailbox`);
after it, each sink has a courier thread of its own (`gradtrack.delivery.courier`), so neither the
training thread nor the worker ever waits on a tracker, and a failing sink is reported once
and never stops the others. (A "raise" rule's exception is the training thread's, see
`gradtrack.capture.stepper`; "skip" acts there too.)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Literal

from gradtrack.alerts import AlertEngine
from gradtrack.config import GradtrackConfig
from gradtrack.delivery.courier import Outbox, yield_cpu_to_training
from gradtrack.errors import GradientWarning
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord
from gradtrack.handoff.mailbox import (
    Control,
    DropCount,
    Mailbox,
    PendingStep,
    QueuedStep,
    UpdateFollowUp,
)
from gradtrack.lifecycle import Outcome
from gradtrack.log import logger, report, warn
from gradtrack.sinks.base import GradientSink
from gradtrack.worker.assemble import AssembledStep, Assembler


class Worker:
    """Moves steps from the mailbox through assembly and the rules to the `Outbox`, on its
    own thread. It never calls a sink: each sink's courier thread does."""

    def __init__(
        self,
        assembler: Assembler,
        sinks: Sequence[GradientSink],
        mailbox: Mailbox,
        config: GradtrackConfig,
        act: Callable[[AlertEvent], None],
        drops: DropCount | None = None,
        on_handed: Callable[[int], None] | None = None,
    ) -> None:
        """``act``: what each alert event asks (`AlertActions.act` in the training process;
        sent back to it from a worker process, `gradtrack.worker.process`). ``on_handed``:
        told `handed` after each batch handed to delivery (the worker process tells the
        training process, which counts what a dying worker process took with it)."""
        self.drops = drops = drops or DropCount(report)
        self.outbox = Outbox(sinks, config, drops, queued=mailbox.__len__)
        self.record_errors = 0
        self.assembler = assembler
        self._mailbox = mailbox
        self._max_batch_steps = config.delivery.max_batch_steps
        self._gather_s = config.delivery.batch_wait_s
        self._act = act
        self._on_handed = on_handed
        self.handed = 0  # steps whose records and alerts delivery has (in the spool, if any)
        self._awaiting: AssembledStep | None = None  # a judged step, until its update follows
        self._thread = threading.Thread(target=self._run, name="gradtrack-worker", daemon=True)
        self._thread.start()

    @property
    def sinks(self) -> list[GradientSink]:
        return self.outbox.sinks

    @property
    def sink_errors(self) -> list[int]:
        return self.outbox.sink_errors

    @property
    def delivery_failures(self) -> list[int]:
        """Per sink, sends that failed and were retried."""
        return [courier.failures for courier in self.outbox.couriers]

    def sync_hint(self) -> str:
        """Where undelivered items wait, and the command that delivers them."""
        return self.outbox.sync_hint()

    def request(
        self, kind: Literal["flush", "stop"], timeout_s: float, outcome: Outcome = "FINISHED"
    ) -> bool:
        """Ask the worker to flush (or flush and close) the sinks; False if delivery made no
        progress for ``timeout_s`` (an outage), or was interrupted (Ctrl-C: the spool keeps
        what is left, and says so). While steps flow there is no cut: a progress line is
        logged every few seconds. ``outcome``: how training ended, for tracker sinks (MLflow
        marks a run it started FINISHED, FAILED or KILLED)."""
        if not self._thread.is_alive():
            return True
        control = Control(kind, outcome)
        self._mailbox.put_control(control)
        done = self.outbox.wait(control.done, timeout_s)
        if done and kind == "stop":
            # Let the thread end (and free its tensors) before the caller goes on: at
            # interpreter exit a worker still tearing down can abort the process.
            self._thread.join(timeout_s)
        return done

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the worker's thread to end (after a stop)."""
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # a bug must be told, not die silently with the data
            report(f"gradtrack's worker thread stopped: {exc!r}; steps are no longer delivered")
            self._mailbox.close()

    def _serve(self) -> None:
        yield_cpu_to_training()
        while True:
            records: list[StepRecord] = []
            events: list[AlertEvent] = []
            steps = 0
            for item in self._mailbox.take(self._max_batch_steps, self._gather_s):
                if not isinstance(item, Control):
                    self._process(item, records, events)
                    steps += isinstance(item, PendingStep)
                    continue
                self._release_awaiting(records)
                self._hand_over(records, events, steps)
                records, events, steps = [], [], 0
                closing = item.outcome if item.kind == "stop" else None
                self.outbox.finish(item.done, closing)
                if item.kind == "stop":
                    return
            self._hand_over(records, events, steps)

    def _hand_over(self, records: list[StepRecord], events: list[AlertEvent], steps: int) -> None:
        """A batch's records and alerts to delivery (the spool first, where there is one);
        ``steps``: the steps they came from, counted in `handed`."""
        self.outbox.hand_over(records, events)
        self.handed += steps
        if steps and self._on_handed is not None:
            self._on_handed(self.handed)

    def _process(
        self, item: QueuedStep, records: list[StepRecord], events: list[AlertEvent]
    ) -> None:
        if isinstance(item, UpdateFollowUp):  # for the judged step held for it, if any
            if self._awaiting is not None:
                self.assembler.add_update(self._awaiting, item)
            self._release_awaiting(records)
            return
        self._release_awaiting(records)  # (its update did not come)
        try:
            step = self.assembler.assemble(item)
        except Exception as exc:  # a bug here must not stop the worker
            if item.reply is not None:
                item.reply.fail()
            self.record_errors += 1
            if self.record_errors == 1:
                report(f"gradtrack could not summarise step {item.step}: {exc!r}")
            return
        if item.reply is not None:
            item.reply.answer(self._raising(step.events))
        if item.expects_update:
            self._awaiting = step
        else:
            records.extend(step.records)
        for event in step.events:
            if not event.silenced:  # within its rule's cooldown: it only raised
                events.append(event)
                self._act(event)

    def _release_awaiting(self, records: list[StepRecord]) -> None:
        """A judged step's records, held for its update, go on."""
        awaiting, self._awaiting = self._awaiting, None
        if awaiting is not None:
            records.extend(awaiting.records)

    def _raising(self, events: list[AlertEvent]) -> AlertEvent | None:
        """The first of a step's events whose rule's action is "raise"."""
        engine = self.assembler.alert_engine
        for event in events:
            if engine.rule(event.rule, event.layer).action == "raise" and event.severity != "info":
                return event
        return None


_LOG_LEVEL = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class AlertActions:
    """Each event reaches the terminal once: as a `GradientWarning` where its rule's action is
    "warn", else as a logging record at its severity; then ``on_alert`` is called with it (its
    first failure reported, none stopping the worker)."""

    def __init__(
        self, engine: AlertEngine, on_alert: Callable[[AlertEvent], None] | None = None
    ) -> None:
        self.engine = engine
        self.on_alert = on_alert
        self.callback_errors = 0

    def act(self, event: AlertEvent) -> None:
        action = self.engine.rule(event.rule, event.layer).action
        if event.severity == "info":
            action = "log"
        if action == "warn":
            warn(event.message, GradientWarning)
        elif action == "log":
            logger.log(_LOG_LEVEL[event.severity], "%s", event.message)
        if self.on_alert is not None:
            try:
                self.on_alert(event)
            except Exception as exc:
                self.callback_errors += 1
                if self.callback_errors == 1:
                    report(f"gradtrack's on_alert callback failed: {exc!r}")
