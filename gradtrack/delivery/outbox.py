"""The run's delivery, as the worker sees it: an `Outbox` it hands each batch's records and
alerts to, asks to flush or close, and waits on; and waiting for delivery while it makes
progress, at close and in ``gradtrack sync`` (`wait_while_progressing`).

The outbox decides once, per sink, how that sink is delivered to: a `TrackerSink` (MLflow)
from the run's spool (`gradtrack.delivery.spool`, on disk, or in memory where it is off or
cannot be made) by a `SpooledCourier`; any other sink by a `Courier` that keeps its waiting
steps in memory. The worker never asks which kind it holds. At close, once every courier is
done, the spool is removed if every sink has everything, else kept and named with the
command that delivers the rest (`sync_hint`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from gradtrack.config import GradtrackConfig
from gradtrack.delivery.courier import Courier, SinkCourier, SpooledCourier
from gradtrack.delivery.spool import Spool, SpoolError, default_root
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord
from gradtrack.handoff.mailbox import DropCount
from gradtrack.lifecycle import Outcome
from gradtrack.log import logger, report
from gradtrack.sinks.base import GradientSink, TrackerSink


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
        self.couriers: list[SinkCourier] = []
        for key, sink in zip(ids, sinks):
            tracker = trackers.get(key)
            if tracker is not None and self.spool is not None:
                self.couriers.append(SpooledCourier(tracker, self.spool, key, report))
            else:
                self.couriers.append(Courier(sink, capacity, drops, report))
        self._patience_s = config.flush_timeout_s
        self._sync_told = False  # the sync command was named already

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
        parts = [f"{waiting:,} step(s) not yet summarised"] if waiting else []
        named = len(self.couriers) > 1
        for courier in self.couriers:
            told = courier.describe_left()
            if told:
                parts.append(f"{type(courier.sink).__name__} {told}" if named else told)
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
