"""Delivery to the sinks: the `Outbox` the worker hands each batch's records and alerts to,
one courier thread per sink behind it, and waiting for delivery while it makes progress, at
close and in ``gradtrack sync`` (`wait_while_progressing`). The worker never waits on a
tracker.

The outbox decides once, per sink, how that sink is delivered to. A `TrackerSink` (MLflow)
is delivered from the run's spool (`gradtrack.delivery.spool`: on disk, or in memory where
it is off or cannot be made) by a `SpooledCourier`: the spool is its only backlog, the
courier its only retry loop, and its cursors move once `send` returned (the tracker holds
the batch). Nothing is lost however long the tracker is away; only the spool's disk bound
can drop. Any other sink (memory, console, W&B, your own) has a `Courier` that keeps its
waiting steps in memory, bounded by ``capacity`` steps, the oldest dropped and counted. A
sink that blocks — a frozen server, a cold start importing its SDK and creating its store, a
locked database — holds up only its own courier. At close, once every courier is done, the
spool is removed if every sink has everything, else kept and named with the command that
delivers the rest (`Outbox.sync_hint`).
"""

from __future__ import annotations

import math
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gradtrack.config import GradtrackConfig
from gradtrack.delivery.spool import Item, Spool, SpoolError, default_root
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord
from gradtrack.handoff.mailbox import DropCount
from gradtrack.lifecycle import Outcome
from gradtrack.log import logger, report
from gradtrack.sinks.base import GradientSink, TrackerSink, as_sink_base


class Outbox:
    """Every sink's courier, and the run's spool where a tracker sink needs one. ``queued``
    counts the steps still waiting for the worker: they are left to deliver too (the close
    progress line names them). Its methods are called on the worker's thread, except
    `wait` and `sync_hint` (the thread that flushes or closes the watcher); none waits on a
    sink."""

    def __init__(
        self,
        sinks: Sequence[GradientSink],
        config: GradtrackConfig,
        drops: DropCount,
        queued: Callable[[], int] = lambda: 0,
    ) -> None:
        self.drops = drops
        self._queued = queued
        ids = [sink_id(i, sink) for i, sink in enumerate(sinks)]
        trackers = {
            key: sink for key, sink in zip(ids, sinks) if isinstance(sink, TrackerSink)
        }  # the one place a sink's kind is asked
        self.spool = open_spool(trackers, config)
        capacity = config.delivery.sink_buffer_steps
        give_way = GiveWay(queued, 2 * config.delivery.max_batch_steps)  # (two batches)
        self.couriers: list[SinkCourier] = []
        for key, sink in zip(ids, sinks):
            tracker = trackers.get(key)
            if tracker is not None and self.spool is not None:
                courier = SpooledCourier(tracker, self.spool, key, report, give_way=give_way)
                self.couriers.append(courier)
            else:
                self.couriers.append(Courier(sink, capacity, drops, report))
        self._patience_s = config.flush_timeout_s
        self._sync_told = False  # the sync command was named already
        self._closing = False  # a close was posted: once the sinks are done, the spool closes

    @property
    def sinks(self) -> list[GradientSink]:
        return [courier.sink for courier in self.couriers]

    @property
    def sink_errors(self) -> list[int]:
        return [courier.errors for courier in self.couriers]

    def hand_over(self, records: list[StepRecord], events: list[AlertEvent]) -> None:
        """A batch's records, then its alerts: into the spool, then to every courier."""
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

    def finish(self, done: threading.Event, closing: Outcome | None = None) -> None:
        """Have every sink flush after what it was handed — and with ``closing`` (how
        training ended) then close — and set ``done`` once all have: waited for on a thread
        of its own, so that a sink stuck on its tracker never holds up the worker."""
        if closing is not None and self.spool is not None:
            self.spool.note_outcome(closing)
            self._closing = True
        finished = []
        for courier in self.couriers:
            finished.append(courier.request_flush(self._patience_s))
            if closing is not None:  # the sink's outcome is set on its courier's thread
                finished.append(courier.request_close(closing, self._patience_s))

        def wait() -> None:
            for event in finished:
                event.wait()
            if closing is not None and self.spool is not None:
                self._release_spool(self.spool)
            done.set()

        threading.Thread(target=wait, name="gradtrack-flush", daemon=True).start()

    def wait(self, done: threading.Event, timeout_s: float) -> bool:
        """Wait for ``done`` (a `finish`'s) while delivery progresses: False once it made
        none for ``timeout_s`` (an outage). Ctrl-C here says where the rest waits."""
        what = "delivering to " + ", ".join(type(sink).__name__ for sink in self.sinks)
        try:
            return wait_while_progressing(
                done,
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

    def left(self) -> int:
        """Steps and alerts not yet delivered: waiting for the worker, or in the spool."""
        return self._queued() + max((c.left for c in self.couriers), default=0)

    def describe_left(self) -> str:
        """What delivery still waits for, by kind and count (the progress line's words)."""
        waiting = self._queued()
        parts = [f"{waiting:,} step(s) of gradients to summarise"] if waiting else []
        named = len(self.couriers) > 1
        for courier in self.couriers:
            told = courier.describe_left()
            if told:
                parts.append(f"{type(courier.sink).__name__} {told}" if named else told)
        if not parts and self._closing:  # (every sink done: the close thread releases it)
            return "closing the run's spool"
        return "; ".join(parts)

    def _starting(self) -> bool:
        return any(c.starting and c.left for c in self.couriers)

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
        path = None if self.spool is None else self.spool.path
        self._sync_told = path is not None
        return sync_hint(path, self.left())

    def targets(self) -> list[dict[str, Any] | None]:
        """Per sink, how its tracker's run is reached now (`TrackerSink.spool_target`; None
        for a sink without a spool)."""
        return [courier.target for courier in self.couriers]

    def state(self) -> DeliveryState:
        """What the training process of a worker process asks of delivery (see
        `gradtrack.worker.process`), taken at once."""
        return DeliveryState(
            left=self.left(),
            waiting_for=self.describe_left(),
            starting=self._starting(),
            sink_errors=tuple(self.sink_errors),
            failures=tuple(courier.failures for courier in self.couriers),
            spool=None if self.spool is None or self.spool.path is None else str(self.spool.path),
        )


@dataclass(frozen=True)
class DeliveryState:
    """Delivery as an `Outbox` sees it: items left, the progress line's words, whether a
    first connection is under way, each sink's failed calls and retried sends, the spool's
    folder (None: in memory)."""

    left: int
    waiting_for: str
    starting: bool
    sink_errors: tuple[int, ...]
    failures: tuple[int, ...]
    spool: str | None


def sync_hint(path: Path | str | None, left: int) -> str:
    """Where undelivered items wait, and the command that delivers them.

    >>> sync_hint(None, 3)
    'steps still queued are lost with this process (the spool is off)'
    >>> sync_hint("/r", 2).split(";")[1]
    ' deliver them with: gradtrack sync /r'
    """
    if path is None:
        return "steps still queued are lost with this process (the spool is off)"
    return (
        f"{left:,} item(s) (steps and alerts) not yet delivered are kept in {path}; "
        f"deliver them with: gradtrack sync {path}"
    )


def sink_id(index: int, sink: GradientSink) -> str:
    """The name a sink's cursor has in the spool, e.g. ``0-MlflowSink``."""
    return f"{index}-{type(sink).__name__}"


def open_spool(trackers: dict[str, TrackerSink], config: GradtrackConfig) -> Spool | None:
    """The run's spool for the tracker sinks (id → sink), None without one: on disk if
    ``config.spool.enabled`` and it can be created there (else that is reported), in memory
    otherwise."""
    if not trackers:
        return None
    targets: dict[str, dict[str, Any]] = {
        key: sink.spool_target() for key, sink in trackers.items()
    }
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


_LINE_EVERY_S = 5.0


def wait_while_progressing(
    done: threading.Event,
    left: Callable[[], int],
    patience_s: float,
    what: str,
    busy: Callable[[], bool] = lambda: False,
    line_every_s: float | None = None,
    waiting_for: Callable[[], str] | None = None,
) -> bool:
    """Wait for ``done``; True once set. False once ``left()`` (items still to deliver) has
    not gone down for ``patience_s`` while not ``busy()`` (a first connection under way: an
    SDK's import, a store's creation). While waiting longer than ``line_every_s`` (5 s), logs
    ``what``'s progress every ``line_every_s``: what it waits for (``waiting_for()``: the
    kinds of item left and their counts, or the sink's own last step), rate, time to go."""
    every_s = _LINE_EVERY_S if line_every_s is None else line_every_s
    start = last_line = time.monotonic()
    fewest = first = _safe(left)
    progress_at = start
    while not done.wait(min(0.25, patience_s)):
        now = time.monotonic()
        count = _safe(left)
        if count < fewest or _safe(busy):
            fewest, progress_at = min(count, fewest), now
        if now - progress_at > patience_s:
            return done.is_set()
        if now - last_line >= every_s:
            last_line = now
            detail = _safe_text(waiting_for) if waiting_for is not None else None
            line = progress_line(what, count, first - count, now - start, detail)
            logger.info("%s", line)
    return True


def progress_line(
    what: str, left: int, delivered: int, elapsed_s: float, detail: str | None = None
) -> str:
    """``delivering to MLflow: 2,340 item(s) left, 850/s, about 3 s to go``; ``detail``
    says what is left instead of the bare count (and, with nothing left, what is waited for).

    >>> progress_line("delivering to MLflow", 2340, 8500, 10.0)
    'delivering to MLflow: 2,340 item(s) left, 850/s, about 3 s to go'
    >>> progress_line("delivering to MLflow", 10, 0, 10.0)
    'delivering to MLflow: 10 item(s) left, none delivered for 10 s'
    >>> progress_line("delivering to MLflow", 0, 4000, 20.0, "ending its run")
    'delivering to MLflow: every item delivered, ending its run, for 20 s'
    """
    if left == 0:
        waited = detail or "the sinks finishing"
        return f"{what}: every item delivered, {waited}, for {elapsed_s:.0f} s"
    told = detail or f"{left:,} item(s)"
    rate = delivered / elapsed_s if elapsed_s > 0 else 0.0
    if rate <= 0:
        return f"{what}: {told} left, none delivered for {elapsed_s:.0f} s"
    return f"{what}: {told} left, {rate:,.0f}/s, about {max(1.0, left / rate):,.0f} s to go"


def _safe_text(read: Callable[[], str]) -> str | None:
    try:
        return read() or None
    except Exception:  # a closed spool: the count alone
        return None


def _safe(read: Callable[[], int]) -> int:
    try:
        return int(read())
    except Exception:  # a closed spool: nothing more to count
        return 0


@dataclass
class CourierCall:
    """One call posted to a courier, made on its thread in the order posted: ``write`` a
    batch of ``records``, ``alert`` an ``event``, ``flush``, or ``close`` (the sink told how
    training ended first: ``outcome``, None to leave it as it is). A spooled courier makes a
    flush or close once every item through seq ``through`` went, or once ``patience_s``
    passed without a send going through. ``done`` is set once the call returned."""

    method: Literal["write", "alert", "flush", "close"]
    records: list[StepRecord] = field(default_factory=list)
    event: AlertEvent | None = None
    outcome: str | None = None
    through: int = 0
    patience_s: float = math.inf
    done: threading.Event = field(default_factory=threading.Event)


class SinkCourier(ABC):
    """What the worker knows of a sink's delivery thread, whichever kind it is: hand it a
    batch's records and alerts, ask it to flush or close, and read how much of the spool it
    has still to deliver. The worker calls these on its own thread; they never wait on the
    sink. A courier without a spool (`Courier`) has nothing left in it and is never
    starting. Every call to the sink itself comes from the courier's thread, and a failing
    call is reported once."""

    def __init__(self, sink: GradientSink, on_error: Callable[[str], None]) -> None:
        self.sink = sink  # as it was given (what `Watcher.sinks` shows)
        self.errors = 0
        self.failures = 0  # sends that failed and were retried (a spooled courier's)
        self._name = type(sink).__name__
        self._on_error = on_error
        self._calls: deque[CourierCall] = deque()
        self._changed = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name=f"gradtrack-{self._name}", daemon=True
        )

    @property
    @abstractmethod
    def left(self) -> int:
        """Items of the run's spool this courier has not delivered yet (0 without a spool:
        steps waiting in memory are not counted here)."""

    def describe_left(self) -> str:
        """What this courier still has to do, for the close/sync progress line, without the
        sink's name ("" if nothing it can name)."""
        return ""

    @property
    @abstractmethod
    def starting(self) -> bool:
        """The first delivery (an SDK's import, a run's creation) is under way."""

    @property
    def target(self) -> dict[str, Any] | None:
        """How the sink's tracker run is reached, as the spool records it (None: no spool)."""
        return None

    @abstractmethod
    def hand_over(self, records: Sequence[StepRecord], events: Sequence[AlertEvent]) -> None:
        """A batch's records, then its alerts (once in the spool, if this courier reads one)."""

    @abstractmethod
    def request_flush(self, patience_s: float) -> threading.Event:
        """Have the sink flush after everything handed over; the event is set once it did
        (or delivery gave up waiting, after ``patience_s`` without progress)."""

    @abstractmethod
    def request_close(self, outcome: str, patience_s: float) -> threading.Event:
        """Then set the sink's ``outcome`` and close it (a tracker sink: `TrackerSink.end`),
        on the courier thread; the thread ends there."""

    def _call(self, method: str, call: Callable[..., object], *args: Any) -> bool:
        try:
            call(*args)
            return True
        except Exception as exc:  # one broken sink must not stop the others
            self.errors += 1
            if self.errors == 1:
                self._on_error(
                    f"gradtrack sink {self._name}.{method} failed: {exc!r}; "
                    "training and the other sinks go on, further errors are only counted"
                )
            return False

    @abstractmethod
    def _run(self) -> None:
        """The courier thread."""


class Courier(SinkCourier):
    """Calls one sink from its own thread, in the order the calls were posted; steps wait in
    memory (at most ``capacity``). A plain `GradientSink` gets `SinkBase`'s defaults."""

    def __init__(
        self,
        sink: GradientSink,
        capacity: int,
        drops: DropCount,
        on_error: Callable[[str], None],
    ) -> None:
        super().__init__(sink, on_error)
        self._sink_base = as_sink_base(sink)
        self._capacity = capacity
        self._drops = drops
        self._steps = 0  # records waiting in write calls
        self._thread.start()

    @property
    def left(self) -> int:
        return 0  # no spool: what waits is in memory, bounded by ``capacity``

    @property
    def starting(self) -> bool:
        return False

    def hand_over(self, records: Sequence[StepRecord], events: Sequence[AlertEvent]) -> None:
        if records:
            self.write(records)
        for event in events:
            self.alert(event)

    def request_flush(self, patience_s: float) -> threading.Event:
        return self.post(CourierCall("flush"))

    def request_close(self, outcome: str, patience_s: float) -> threading.Event:
        return self.post(CourierCall("close", outcome=outcome))

    def post(self, call: CourierCall) -> threading.Event:
        """Queue ``call``; its event is set once the sink's method has returned."""
        with self._changed:
            self._calls.append(call)
            self._changed.notify_all()
        return call.done

    def write(self, batch: Sequence[StepRecord]) -> None:
        with self._changed:
            self._calls.append(CourierCall("write", records=list(batch)))
            self._steps += len(batch)
            self._trim()
            self._changed.notify_all()

    def alert(self, event: AlertEvent) -> None:
        self.post(CourierCall("alert", event=event))

    def _make(self, call: CourierCall) -> None:
        """The sink's method a call names, on this courier's thread."""
        sink = self._sink_base
        if call.method == "write":
            sink.write(call.records)
        elif call.method == "alert":
            assert call.event is not None
            sink.alert(call.event)
        elif call.method == "flush":
            sink.flush()
        else:
            if call.outcome is not None:
                sink.outcome = call.outcome
            sink.close()

    def _trim(self) -> None:
        """Past ``capacity`` waiting steps, drop the oldest (never a flush, alert or close)."""
        while self._steps > self._capacity:
            index = next(i for i, call in enumerate(self._calls) if call.method == "write")
            batch = self._calls[index].records
            batch.pop(0)
            self._steps -= 1
            if not batch:
                del self._calls[index]
            self._drops.add(
                1,
                f"{self._name} is {self._capacity} steps behind "
                "(its tracker is slow or unreachable)",
            )

    def _run(self) -> None:
        yield_cpu_to_training()  # an SDK's import or a store's creation: after training
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._calls))
                call = self._calls.popleft()
                if call.method == "write":
                    self._steps -= len(call.records)
            self._call(call.method, self._make, call)
            call.done.set()
            if call.method == "close":
                return


_ALERT_WAIT_S = 1.0  # an alert waits at most this long for company


class _Lane:
    """One stream of a tracker sink's items from the spool, with a cursor of its own: every
    item (records and alerts, to `send`), or the records that carry histograms (to
    `send_histograms`); when its next batch is due, and what waits on it."""

    def __init__(
        self, spool: Spool, cursor: str, histograms: bool, batch: int, sink: TrackerSink
    ) -> None:
        self.spool, self.cursor, self.histograms, self.batch = spool, cursor, histograms, batch
        self.sink = sink  # (its waits: gather_s, histogram_wait_s)
        spool.add_cursor(cursor)
        self.position = spool.cursor(cursor)  # every item through it is delivered
        self.pending: list[Item] | None = None  # the batch being sent (again, after a failure)
        self.pending_through = 0  # the seq it was read through
        self.waiting_since: float | None = None  # when items were first seen waiting

    def read(self, through: int) -> list[Item]:
        if self.pending is None:  # a batch that failed is sent again as it was read
            self.pending = self.spool.read(self.position, self.batch, through, self.histograms)
            self.pending_through = through
        return self.pending

    def passed(self, through: int) -> None:
        """Every item of this lane through ``through`` is delivered (or none was waiting)."""
        self.pending, self.waiting_since = None, None
        if through > self.position:
            self.position = through
            self.spool.confirm(self.cursor, through)

    def due_in(self, count: int, alerts: int, now: float, last_sent: float) -> float:
        """Seconds until ``count`` waiting items (``alerts`` of them alerts) are due to go:
        a full batch at once; histograms ``histogram_wait_s`` after they were first seen
        waiting; an alert ``_ALERT_WAIT_S``, anything else ``gather_s``, after the last send."""
        if count >= self.batch:
            return 0.0
        assert self.waiting_since is not None
        if self.histograms:
            return self.waiting_since + self.sink.histogram_wait_s - now
        if alerts:
            return last_sent + _ALERT_WAIT_S - now
        return last_sent + self.sink.gather_s - now

    def left(self) -> str:
        """What waits on this lane: steps of metrics and alerts, or steps of histograms."""
        count, alerts = self.spool.waiting(self.position, self.spool.last_seq, self.histograms)
        if self.histograms:
            return f"{count:,} step(s) of histograms" if count else ""
        told = [f"{count - alerts:,} step(s) of metrics"] if count > alerts else []
        return ", ".join(told + ([f"{alerts:,} alert(s)"] if alerts else []))


# What a tracker sink does in a posted call, for the progress line.
_DOING = {"close": "ending its run (its last pictures and files)", "flush": "flushing its tracker"}


class GiveWay:
    """A tracker's writes give way to the worker while it is behind — more steps wait for it
    than ``steps`` — yet keep `SHARE` of the time: after a send, the next waits at most
    (1 − `SHARE`) / `SHARE` times as long as that send took (three times; at least
    `FLOOR_S`). A batch of MLflow's metrics holds the GIL for seconds (its SQL store's ORM).
    In a worker process that cannot keep up with both, the steps it has not reduced fill the
    ring the training process lays their copies in, and past the ring the training process
    reduces them itself, holding the GIL training needs; what the tracker has not taken
    waits in the spool, all of it delivered by ``close()``."""

    WAIT_S = 0.05  # how long a write waits before its courier looks again
    SHARE = 0.25
    FLOOR_S = 1.0

    def __init__(self, queued: Callable[[], int], steps: int) -> None:
        self._queued, self._steps = queued, steps

    def wait_s(self, last_sent: float, send_s: float) -> float | None:
        """How long a courier whose last send ended at ``last_sent`` and took ``send_s``
        waits before it looks again (None: it sends now)."""
        quiet_s = max(self.FLOOR_S, send_s * (1 - self.SHARE) / self.SHARE)
        if time.monotonic() - last_sent < quiet_s and self._queued() > self._steps:
            return self.WAIT_S
        return None


class Outage:
    """A tracker's failing sends: each is tried again after a backoff (0.5 s doubling to the
    sink's ``retry_max_s``), the outage warned about once, until a send goes through."""

    def __init__(self, tracker: TrackerSink) -> None:
        self._tracker = tracker
        self._backoff_s = 0.0
        self.retry_at = 0.0  # (monotonic) no send before it
        self._told = False
        self.stalled = False  # the tracker refuses, and waiting does not help

    def failed(self, error: Exception, name: str) -> None:
        self._backoff_s = min(self._tracker.retry_max_s, max(0.5, self._backoff_s * 2))
        self.retry_at = time.monotonic() + self._backoff_s
        try:
            self.stalled = not self._tracker.waiting_helps(error)
            message = self._tracker.failure_message(error)
        except Exception as exc:
            message = f"{name} failed: {error!r} (and {exc!r})"
        if not self._told:
            self._told = True
            report(message)

    def recovered(self) -> None:
        self._backoff_s, self.retry_at = 0.0, 0.0
        self._told = self.stalled = False


class SpooledCourier(SinkCourier):
    """Delivers a `TrackerSink`'s items from the spool, in order, each once; the only place
    delivery retries. A batch that fails is sent again (`Outage`); the spool holds everything
    meanwhile. Calls posted (flush, close) run once every item appended before them went;
    other sends give way to the worker while it is behind (``give_way``)."""

    _IDLE_S = 0.5

    def __init__(
        self,
        sink: TrackerSink,
        spool: Spool,
        sink_id: str,
        on_error: Callable[[str], None],
        start: bool = True,
        give_way: GiveWay | None = None,
    ) -> None:
        super().__init__(sink, on_error)
        self.spool, self.sink_id, self._tracker = spool, sink_id, sink
        self._give_way = give_way
        self._yielding = False  # the last look gave way to the worker: wait, news or not
        self._lanes = [_Lane(spool, sink_id, False, sink.batch_items, sink)]
        if sink.histogram_steps > 0:
            cursor = f"{sink_id}/histograms"
            self._lanes.append(_Lane(spool, cursor, True, sink.histogram_steps, sink))
        self._available = spool.last_seq  # appended items the worker has announced
        self._last_sent = -float("inf")
        self._send_s = 0.0  # how long the last send took
        self._outage = Outage(sink)
        self._progress_at = -float("inf")  # the last send that went
        self.broken: str | None = None  # why delivery stopped for good (an unreadable spool)
        self._opened = False
        self._starting = True  # the first send (an SDK's import, a run's creation) is under way
        self._waiting_for: CourierCall | None = None  # the flush or close delivery is waited for
        self._ending: str | None = None  # what the sink does in a flush or close under way
        self._waiting_since = 0.0
        self._target = self._safe_target()
        if start:
            self._thread.start()

    def announce(self, last_seq: int) -> None:
        """Items through ``last_seq`` are in the spool."""
        with self._changed:
            self._available = max(self._available, last_seq)
            self._changed.notify_all()

    @property
    def starting(self) -> bool:
        return self._starting

    def hand_over(self, records: Sequence[StepRecord], events: Sequence[AlertEvent]) -> None:
        self.announce(self.spool.last_seq)  # the worker appended them to the spool

    def request_flush(self, patience_s: float) -> threading.Event:
        return self.post_after("flush", patience_s)

    def request_close(self, outcome: str, patience_s: float) -> threading.Event:
        return self.post_after("close", patience_s, outcome)

    def post_after(
        self,
        method: Literal["flush", "close"],
        patience_s: float = math.inf,
        outcome: str | None = None,
    ) -> threading.Event:
        """Queue a flush or a close (with the run's ``outcome``), to run once every item
        announced so far was delivered, or ``patience_s`` passed without progress."""
        with self._changed:
            call = CourierCall(
                method, outcome=outcome, through=self._available, patience_s=patience_s
            )
            self._calls.append(call)
            self._changed.notify_all()
        return call.done

    def run_here(self) -> None:
        """Run the delivery loop on the calling thread (``gradtrack sync``)."""
        self._run()

    def _run(self) -> None:
        yield_cpu_to_training()
        try:
            self._serve()
        except Exception as exc:  # an unreadable spool: told, and no one is left waiting
            self.broken = str(exc)
            self._on_error(f"gradtrack stopped delivering to {self._name}: {exc}")
            with self._changed:
                calls, self._calls = list(self._calls), deque()
            for call in calls:
                call.done.set()

    def _serve(self) -> None:
        while True:
            with self._changed:
                call = self._calls[0] if self._calls else None
                through = self._available if call is None else call.through
            wait_s = self._deliver(through, forced=call is not None)
            if wait_s is None:
                continue  # sent something: look again at once
            if call is not None and all(lane.position >= through for lane in self._lanes):
                self._run_call(call, complete=True)
                if call.method == "close":
                    return
                continue
            if call is not None and self._given_up(call):
                self._run_call(call, complete=False)
                if call.method == "close":
                    return
                continue
            with self._changed:
                head = self._calls[0] if self._calls else None
                news = head is not call or (call is None and self._available > through)
                if not news or (self._yielding and head is call):
                    self._changed.wait(wait_s)

    def _deliver(self, through: int, forced: bool) -> float | None:
        """Send what is due on every lane: None if something went, else how long to wait
        before anything can be due."""
        now = time.monotonic()
        if now < self._outage.retry_at:
            return self._outage.retry_at - now
        hold = (
            None
            if forced or self._give_way is None
            else self._give_way.wait_s(self._last_sent, self._send_s)
        )
        self._yielding = hold is not None
        if hold is not None:
            return hold
        waits, sent = [self._IDLE_S], False
        for lane in self._lanes:
            count, alerts = self.spool.waiting(lane.position, through, lane.histograms)
            if count == 0:
                if lane.position < through and (forced or lane.histograms):
                    lane.passed(through)  # nothing of this lane's kind waits
                continue
            if lane.waiting_since is None:
                lane.waiting_since = now
            due_in = 0.0 if forced else lane.due_in(count, alerts, now, self._last_sent)
            if due_in > 0:
                waits.append(due_in)
            elif self._send(lane, through):
                sent = True
            else:
                return max(0.0, self._outage.retry_at - time.monotonic())
        return None if sent else min(waits)

    def _send(self, lane: _Lane, through: int) -> bool:
        items = lane.read(through)
        if not items:
            lane.passed(through)
            return True
        payloads = [item.payload for item in items]
        try:
            if not self._opened:
                self._tracker.open()
                self._opened = True
                self._describe()  # which run, before anything goes to it
            started = time.monotonic()
            if lane.histograms:
                self._tracker.send_histograms(payloads)  # type: ignore[arg-type]
            else:
                self._tracker.send(payloads)
            self._send_s = time.monotonic() - started
        except Exception as exc:
            self._starting = False
            self.failures += 1
            self._outage.failed(exc, self._name)
            return False
        self._starting = False
        self._outage.recovered()
        self._progress_at = time.monotonic()
        full = len(items) >= lane.batch
        # A histogram lane's batch short of full held every histogram record it was read
        # through; any other batch ends at its last item.
        lane.passed(items[-1].seq if full or not lane.histograms else lane.pending_through)
        self._last_sent = time.monotonic()
        self._describe()
        return True

    def _given_up(self, call: CourierCall) -> bool:
        """A flush or close stops waiting for delivery when the tracker refuses (waiting does
        not help), or after the call's ``patience_s`` without a send going through (an
        outage; the spool keeps the rest for `gradtrack sync`)."""
        if self._waiting_for is not call:
            self._waiting_for, self._waiting_since = call, time.monotonic()
        quiet_since = max(self._waiting_since, self._progress_at)
        return self._outage.stalled or time.monotonic() - quiet_since > call.patience_s

    def _run_call(self, call: CourierCall, complete: bool) -> None:
        self._ending = _DOING[call.method]  # (said from before it leaves the queue until done)
        with self._changed:
            self._calls.popleft()
        self._waiting_for = None
        try:
            if call.method == "close":
                self._call("end", self._end, complete, call.outcome)
                self._describe()  # (whether it ended its run)
            else:
                self._call(call.method, self._tracker.flush)
            call.done.set()
        finally:
            self._ending = None

    def describe_left(self) -> str:
        """``1,200 step(s) of metrics, 3 alert(s), 12 step(s) of histograms``, or what the
        sink does once every item went (``ending its run (...)``)."""
        if self._ending is not None:
            return self._ending
        told = ", ".join(filter(None, (lane.left() for lane in self._lanes)))
        if told:
            return told
        try:  # every item went and the flush or close is next: it is what the sink waits on
            return _DOING.get(self._calls[0].method, "")
        except IndexError:
            return ""

    def _end(self, complete: bool, outcome: str | None = None) -> None:
        if outcome is not None:
            self._tracker.outcome = outcome
        self._tracker.end(complete)

    def _describe(self) -> None:
        target = self._safe_target()
        if target is not None and target != self._target:
            self._target = target
            self.spool.describe(self.sink_id, target)

    def _safe_target(self) -> dict[str, Any] | None:
        try:
            return self._tracker.spool_target()
        except Exception:
            return None

    @property
    def left(self) -> int:
        return max(0, self.spool.last_seq - min(lane.position for lane in self._lanes))

    @property
    def target(self) -> dict[str, Any] | None:
        return self._target


def yield_cpu_to_training() -> None:
    """Lower this thread's scheduling priority: on a busy machine the training threads get
    the cores first and gradtrack's threads catch up in their gaps (Linux; elsewhere a no-op)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
