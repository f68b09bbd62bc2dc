"""The worker thread: moves steps from the mailbox, through assembly and the rules, to the
spool and the sinks.

Between the training thread and the worker sits a bounded mailbox (`gradtrack.handoff.mailbox`);
after it, each sink has a courier thread of its own (`gradtrack.delivery.courier`), so neither the
training thread nor the worker ever waits on a tracker, and a failing sink is reported once
and never stops the others.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Literal

from gradtrack.config import GradtrackConfig
from gradtrack.delivery.courier import SinkCourier, courier_for, yield_cpu_to_training
from gradtrack.delivery.progress import wait_while_progressing
from gradtrack.delivery.spool import Spool, SpoolError, default_root
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord
from gradtrack.handoff.mailbox import Control, DropCount, Mailbox, QueuedStep, UpdateFollowUp
from gradtrack.lifecycle import Outcome
from gradtrack.log import report
from gradtrack.sinks.base import GradientSink, TrackerSink
from gradtrack.worker.actions import AlertActions
from gradtrack.worker.assemble import AssembledStep, Assembler


class Worker:
    """Moves steps from the mailbox to the spool and the sinks' couriers, on its own thread.
    It never calls a sink: each sink's courier thread does (`gradtrack.delivery.courier`)."""

    def __init__(
        self,
        assembler: Assembler,
        sinks: Sequence[GradientSink],
        mailbox: Mailbox,
        config: GradtrackConfig,
        on_alert: Callable[[AlertEvent], None] | None = None,
        drops: DropCount | None = None,
    ) -> None:
        self.drops = drops = drops or DropCount(report)
        self.spool = open_spool(sinks, config)
        capacity = config.delivery.sink_buffer_steps
        self.couriers: list[SinkCourier] = [
            courier_for(sink, self.spool, sink_id(i, sink), capacity, drops, report)
            for i, sink in enumerate(sinks)
        ]
        self._patience_s = config.flush_timeout_s
        self._sync_told = False  # the sync command was named already
        self.record_errors = 0
        self.assembler = assembler
        self._mailbox = mailbox
        self._max_batch_steps = config.delivery.max_batch_steps
        self._gather_s = config.delivery.batch_wait_s
        self.actions = AlertActions(assembler.alert_engine, on_alert)
        self._awaiting: AssembledStep | None = None  # a judged step, until its update follows
        self._thread = threading.Thread(target=self._run, name="gradtrack-worker", daemon=True)
        self._thread.start()

    @property
    def sinks(self) -> list[GradientSink]:
        return [courier.sink for courier in self.couriers]

    @property
    def sink_errors(self) -> list[int]:
        return [courier.errors for courier in self.couriers]

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
        what = "delivering to " + ", ".join(type(sink).__name__ for sink in self.sinks)
        try:
            done = wait_while_progressing(
                control.done,
                self.left,
                timeout_s,
                what,
                busy=self._starting,
                waiting_for=self.describe_left,
            )
        except KeyboardInterrupt:
            if self.spool is not None and self.spool.path is not None:
                report(f"gradtrack: interrupted while delivering; {self.sync_hint()}")
            raise
        if done and kind == "stop":
            # Let the thread end (and free its tensors) before the caller goes on: at
            # interpreter exit a worker still tearing down can abort the process.
            self._thread.join(timeout_s)
        return done

    def left(self) -> int:
        """Steps and alerts not yet delivered: waiting for the worker, or in the spool."""
        return len(self._mailbox) + max((c.left for c in self.couriers), default=0)

    def describe_left(self) -> str:
        """What delivery still waits for, by kind and count (the progress line's words)."""
        waiting = len(self._mailbox)
        parts = [f"{waiting:,} step(s) not yet summarised"] if waiting else []
        named = len(self.couriers) > 1
        for courier in self.couriers:
            told = courier.describe_left()
            if told:
                parts.append(f"{type(courier.sink).__name__} {told}" if named else told)
        return "; ".join(parts)

    def _starting(self) -> bool:
        return any(c.starting and c.left for c in self.couriers)

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
            for item in self._mailbox.take(self._max_batch_steps, self._gather_s):
                if not isinstance(item, Control):
                    self._process(item, records, events)
                    continue
                self._release_awaiting(records)
                self._hand_over(records, events)
                records, events = [], []
                self._finish(item)
                if item.kind == "stop":
                    return
            self._hand_over(records, events)

    def _finish(self, control: Control) -> None:
        """Have every sink flush (or flush and close) after what it was handed, and mark
        ``control`` done once all have — waiting for that on a thread of its own, so that
        a sink stuck on its tracker never holds up the worker."""
        if control.kind == "stop" and self.spool is not None:
            self.spool.note_outcome(control.outcome)
        finished = []
        for courier in self.couriers:
            finished.append(courier.request_flush(self._patience_s))
            if control.kind == "stop":  # the sink's outcome is set on its courier's thread
                finished.append(courier.request_close(control.outcome, self._patience_s))

        def wait() -> None:
            for event in finished:
                event.wait()
            if control.kind == "stop" and self.spool is not None:
                self._release_spool(self.spool)
            control.done.set()

        threading.Thread(target=wait, name="gradtrack-flush", daemon=True).start()

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
                self.actions.act(event)

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

    def _hand_over(self, records: list[StepRecord], events: list[AlertEvent]) -> None:
        if self.spool is not None and (records or events):
            self._append(self.spool, records, events)
        for courier in self.couriers:
            courier.hand_over(records, events)

    def _append(self, spool: Spool, records: list[StepRecord], events: list[AlertEvent]) -> None:
        items: list[StepRecord | AlertEvent] = [*records, *events]
        try:
            seqs = spool.append(items)
        except Exception as exc:  # a full disk: counted as lost, told once, never raised
            seqs = [None] * len(items)
            reason = f"the spool at {spool.path or 'memory'} cannot be written ({exc!r})"
        else:
            reason = (
                f"the spool at {spool.path or 'memory'} holds {spool.max_bytes >> 20} MiB not "
                "yet delivered, its bound (spool.mib)"
            )
        lost = sum(seq is None for seq, item in zip(seqs, items) if isinstance(item, StepRecord))
        if lost:
            self.drops.add(lost, reason)

    def _release_spool(self, spool: Spool) -> None:
        """Delete the spool once every sink confirmed it; else keep it and say how to sync."""
        left = spool.undelivered()
        spool.close()
        if left == 0:
            spool.remove()
        elif not self._sync_told:
            self._sync_told = True
            hint = self.sync_hint()
            report(f"gradtrack could not deliver to every tracker before closing; {hint}")

    def sync_hint(self) -> str:
        """Where undelivered items wait, and the command that delivers them."""
        if self.spool is None or self.spool.path is None:
            return "steps still queued are lost with this process (the spool is off)"
        self._sync_told = True
        path = self.spool.path
        return (
            f"{self.left():,} item(s) (steps and alerts) not yet delivered are kept in {path}; "
            f"deliver them with: gradtrack sync {path}"
        )


def sink_id(index: int, sink: GradientSink) -> str:
    """The name a sink's cursor has in the spool, e.g. ``0-MlflowSink``."""
    return f"{index}-{type(sink).__name__}"


def open_spool(sinks: Sequence[GradientSink], config: GradtrackConfig) -> Spool | None:
    """The run's spool, if a sink delivers to a tracker: on disk if ``config.spool.enabled``
    and it can be created there (else that is reported), in memory otherwise."""
    targets = {
        sink_id(i, sink): sink.spool_target()
        for i, sink in enumerate(sinks)
        if isinstance(sink, TrackerSink)
    }
    if not targets:
        return None
    limit = config.spool.mib << 20
    if config.spool.enabled:
        root = config.spool.dir or default_root()
        try:
            return Spool.create(root, config.model_name or "run", targets, limit)
        except (OSError, SpoolError) as exc:
            report(
                f"gradtrack could not create its spool under {root} ({exc!r}); steps wait "
                "in memory instead (set spool.dir or GRADTRACK_SPOOL_DIR to a writable folder)"
            )
    return Spool.in_memory(targets, limit)
