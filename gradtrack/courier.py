"""One delivery thread per sink: the worker hands calls over and never waits on a tracker.

A sink that blocks — a frozen server, a cold start importing its SDK and creating its store,
a locked database — holds up only its own courier. A tracker sink (one that can say what its
tracker really has, see `SpooledCourier`) reads its steps from the run's durable spool and
moves its cursor there once they are delivered: nothing is lost however long the tracker is
away, only the spool's disk bound can drop. Any other sink (memory, console, your own) keeps
its waiting steps in memory, bounded by ``capacity`` steps, the oldest dropped and counted.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from gradtrack.alerts import AlertEvent
from gradtrack.drops import DropCount
from gradtrack.record import StepRecord
from gradtrack.sinks.base import GradientSink
from gradtrack.spool import Item, Spool


@runtime_checkable
class TrackerSink(GradientSink, Protocol):
    """A sink whose deliveries can be confirmed and resumed from a spool in another process."""

    def delivered(self) -> int:
        """How many of the items handed to it (records and alerts, in the order handed) its
        tracker has, every one up to that count: what may leave the spool."""

    def spool_target(self) -> dict[str, Any]:
        """JSON-safe, secret-free: how `gradtrack sync` reaches the same run again."""


_Call = tuple[str, tuple[Any, ...], "threading.Event | None"]


class _Thread:
    """A sink's thread: posted calls run in order; a failing call is reported once."""

    def __init__(self, sink: GradientSink, on_error: Callable[[str], None]) -> None:
        self.sink = sink
        self.errors = 0
        self._on_error = on_error
        self._calls: deque[_Call] = deque()
        self._changed = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name=f"gradtrack-{type(sink).__name__}", daemon=True
        )

    def post(self, method: str, *args: Any) -> threading.Event:
        """Queue ``sink.method(*args)``; the event is set once it has returned."""
        done = threading.Event()
        with self._changed:
            self._calls.append((method, args, done))
            self._changed.notify_all()
        return done

    def _call(self, method: str, *args: Any) -> bool:
        try:
            getattr(self.sink, method)(*args)
            return True
        except Exception as exc:  # one broken sink must not stop the others
            self.errors += 1
            if self.errors == 1:
                self._on_error(
                    f"gradtrack sink {type(self.sink).__name__}.{method} failed: {exc!r}; "
                    "training and the other sinks go on, further errors are only counted"
                )
            return False

    def _run(self) -> None:
        raise NotImplementedError


class Courier(_Thread):
    """Calls one sink from its own thread, in the order the calls were posted; steps wait in
    memory (at most ``capacity``)."""

    def __init__(
        self,
        sink: GradientSink,
        capacity: int,
        drops: DropCount,
        on_error: Callable[[str], None],
    ) -> None:
        super().__init__(sink, on_error)
        self._capacity = capacity
        self._drops = drops
        self._steps = 0  # records waiting in write calls
        self._thread.start()

    def write(self, batch: Sequence[StepRecord]) -> None:
        with self._changed:
            self._calls.append(("write", (list(batch),), None))
            self._steps += len(batch)
            self._trim()
            self._changed.notify_all()

    def alert(self, event: AlertEvent) -> None:
        self.post("alert", event)

    def _trim(self) -> None:
        """Past ``capacity`` waiting steps, drop the oldest (never a flush, alert or close)."""
        while self._steps > self._capacity:
            index = next(i for i, call in enumerate(self._calls) if call[0] == "write")
            batch = self._calls[index][1][0]
            batch.pop(0)
            self._steps -= 1
            if not batch:
                del self._calls[index]
            self._drops.add(
                1,
                f"{type(self.sink).__name__} is {self._capacity} steps behind "
                "(its tracker is slow or unreachable)",
            )

    def _run(self) -> None:
        yield_cpu_to_training()  # an SDK's import or a store's creation: after training
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._calls))
                method, args, done = self._calls.popleft()
                if method == "write":
                    self._steps -= len(args[0])
            self._call(method, *args)
            if done is not None:
                done.set()
            if method == "close":
                return


class SpooledCourier(_Thread):
    """Delivers a tracker sink's items from the spool, in order, each once, and confirms in
    the spool what the tracker has. Calls posted (flush, close) run once every item appended
    before them was handed over."""

    # Items handed to the sink but not confirmed, at most: beyond, the rest wait on disk and
    # the courier only drives the sink's retries.
    MAX_UNCONFIRMED = 2_000
    _RETRY_EVERY_S = 0.5
    _CONFIRM_EVERY_S = 0.2

    def __init__(
        self,
        sink: TrackerSink,
        spool: Spool,
        sink_id: str,
        on_error: Callable[[str], None],
        max_batch_steps: int = 32,
        start: bool = True,
    ) -> None:
        super().__init__(sink, on_error)
        self.spool = spool
        self.sink_id = sink_id
        self._tracker = sink
        self._max_batch = max_batch_steps
        self._reader = spool.reader(spool.cursor(sink_id))
        self._available = spool.last_seq  # appended items the worker has announced
        self._handed: deque[int] = deque()  # seqs handed to the sink, not yet confirmed
        self._handed_count = 0
        self._confirmed_count = 0
        self._unsaved: int | None = None  # confirmed by the tracker, not yet on disk
        self._saved_at = 0.0
        self._target = sink.spool_target()
        if start:
            self._thread.start()

    def announce(self, last_seq: int) -> None:
        """Items through ``last_seq`` are in the spool."""
        with self._changed:
            self._available = max(self._available, last_seq)
            self._changed.notify_all()

    def post_after(self, method: str, *args: Any) -> threading.Event:
        """`post`, to run once every item announced so far was handed over."""
        done = threading.Event()
        with self._changed:
            self._calls.append((method, (self._available, *args), done))
            self._changed.notify_all()
        return done

    def run_here(self) -> None:
        """Run the delivery loop on the calling thread (``gradtrack sync``)."""
        self._run()

    def _run(self) -> None:
        yield_cpu_to_training()
        while True:
            with self._changed:
                self._changed.wait_for(self._work_waiting, timeout=self._RETRY_EVERY_S)
                call = self._calls[0] if self._calls else None
                read_through = self._available if call is None else call[1][0]
            if self._handed_so_far() < read_through:
                self._deliver(read_through)
                continue
            if call is None:
                if self._handed:  # the tracker still owes confirmations: drive its retries
                    self._nudge()
                continue
            with self._changed:
                self._calls.popleft()
            method, (_, *args), done = call
            self._call(method, *args)
            self._confirm(force=True)
            if done is not None:
                done.set()
            if method == "close":
                return

    def _nudge(self) -> None:
        """Drive the sink's retries while its tracker owes confirmations, and take any."""
        self._call("retry" if hasattr(self.sink, "retry") else "flush")
        self._confirm()

    def _work_waiting(self) -> bool:
        return bool(self._calls) or self._handed_so_far() < self._available

    def _handed_so_far(self) -> int:
        return self._reader.position  # the last seq read is handed at once

    def _deliver(self, through: int) -> None:
        """Hand the next items (a batch of records, or one alert) to the sink."""
        if len(self._handed) >= self.MAX_UNCONFIRMED:
            time.sleep(self._RETRY_EVERY_S)  # the tracker is behind: let the disk hold them
            self._nudge()
            return
        items = list(self._reader.items(self._max_batch, through))
        if not items:
            time.sleep(0.01)  # announced but not yet readable (should not happen)
            return
        records: list[Item] = []
        for item in items:
            if isinstance(item.payload, StepRecord):
                records.append(item)
                continue
            self._hand(records)
            records = []
            self._hand([item])
        self._hand(records)
        self._confirm()

    def _hand(self, items: list[Item]) -> None:
        if not items:
            return
        if isinstance(items[0].payload, StepRecord):
            self._call("write", [item.payload for item in items])
        else:
            self._call("alert", items[0].payload)
        self._handed.extend(item.seq for item in items)
        self._handed_count += len(items)

    def _confirm(self, force: bool = False) -> None:
        """Move the spool cursor past what the tracker confirmed: on disk at most every
        0.2 s (each time a small file is replaced), and always when ``force``d."""
        try:
            delivered = min(self._tracker.delivered(), self._handed_count)
        except Exception:  # a sink that cannot tell has delivered nothing new
            delivered = self._confirmed_count
        while self._confirmed_count < delivered:
            self._unsaved = self._handed.popleft()
            self._confirmed_count += 1
        now = time.monotonic()
        if self._unsaved is not None and (force or now - self._saved_at >= self._CONFIRM_EVERY_S):
            self.spool.confirm(self.sink_id, self._unsaved)
            self._unsaved, self._saved_at = None, now
        target = self._safe_target()
        if target is not None and target != self._target:
            self._target = target
            self.spool.describe(self.sink_id, target)

    def _safe_target(self) -> dict[str, Any] | None:
        try:
            return self._tracker.spool_target()
        except Exception:
            return None


def yield_cpu_to_training() -> None:
    """Lower this thread's scheduling priority: on a busy machine the training threads get
    the cores first and gradtrack's threads catch up in their gaps (Linux; elsewhere a no-op)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
