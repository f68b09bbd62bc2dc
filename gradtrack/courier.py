"""One delivery thread per sink: the worker hands calls over and never waits on a tracker.

A sink that blocks — a frozen server, a cold start importing its SDK and creating its store,
a locked database — holds up only its own courier; the steps wait in the courier's queue
(bounded by ``capacity`` steps, the oldest dropped and counted past it) and go out in order.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from gradtrack.record import StepRecord
from gradtrack.sinks.base import GradientSink


class DropCount:
    """Steps lost anywhere between the training thread and the sinks, counted once; the
    first loss is reported (``on_first``), every later one only counted."""

    def __init__(self, on_first: Callable[[str], None]) -> None:
        self.total = 0
        self._on_first = on_first
        self._lock = threading.Lock()

    def add(self, n: int, why: str) -> None:
        with self._lock:
            first = self.total == 0
            self.total += n
        if first:
            self._on_first(
                f"gradtrack dropped {n} step(s): {why}; further losses are counted in "
                "watcher.dropped_steps and logged as gradtrack/dropped"
            )


class Courier:
    """Calls one sink from its own thread, in the order the calls were posted."""

    def __init__(
        self,
        sink: GradientSink,
        capacity: int,
        drops: DropCount,
        on_error: Callable[[str], None],
    ) -> None:
        self.sink = sink
        self.errors = 0
        self._capacity = capacity
        self._drops = drops
        self._on_error = on_error
        self._calls: deque[tuple[str, tuple[Any, ...], threading.Event | None]] = deque()
        self._steps = 0  # records waiting in write calls
        self._changed = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name=f"gradtrack-{type(sink).__name__}", daemon=True
        )
        self._thread.start()

    def write(self, batch: Sequence[StepRecord]) -> None:
        with self._changed:
            self._calls.append(("write", (list(batch),), None))
            self._steps += len(batch)
            self._trim()
            self._changed.notify_all()

    def post(self, method: str, *args: Any) -> threading.Event:
        """Queue ``sink.method(*args)``; the event is set once it has returned."""
        done = threading.Event()
        with self._changed:
            self._calls.append((method, args, done))
            self._changed.notify_all()
        return done

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
            try:
                getattr(self.sink, method)(*args)
            except Exception as exc:  # one broken sink must not stop the others
                self.errors += 1
                if self.errors == 1:
                    self._on_error(
                        f"gradtrack sink {type(self.sink).__name__}.{method} failed: {exc!r}; "
                        "training and the other sinks go on, further errors are only counted"
                    )
            finally:
                if done is not None:
                    done.set()
            if method == "close":
                return


def yield_cpu_to_training() -> None:
    """Lower this thread's scheduling priority: on a busy machine the training threads get
    the cores first and gradtrack's threads catch up in their gaps (Linux; elsewhere a no-op)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
