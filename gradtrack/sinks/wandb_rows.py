"""Placing gradtrack's steps in the user's W&B rows, never moving the user's steps.

W&B keeps one history row open at a time and numbers rows with ``_step``. Whoever commits a
row moves that number, so in a run gradtrack did not start (or once someone else logs) each
gradtrack step rides in one of the user's rows, staged with ``commit=False`` into the open
row while that row holds no gradtrack step yet; a placement thread waits for the user's next
row. A user row carries one gradtrack step; steps still waiting when the run finishes (or
the interpreter exits) get rows of their own then, after all of the user's rows, when nobody
can log any more. Beyond ``PENDING_LIMIT`` waiting steps the oldest are dropped and counted
in the ``gradtrack/coalesced`` summary value (see the README's W&B section).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from gradtrack.record import StepRecord
from gradtrack.sinks.wandb_run import finished, next_row

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run

# Steps waiting for a user row to ride. They keep their order (charts draw them at their own
# gradtrack/step either way), and those still waiting when the run finishes get rows of their
# own then. Beyond this many the oldest are dropped and counted: a user who logs less often
# than gradtrack would otherwise see its charts fall ever further behind training.
PENDING_LIMIT = 1024
# How often the placement thread looks for the user's next row: every millisecond for a
# while after a placement (a user row per training step), then backing off to POLL_MAX_S
# while the user logs rarely, so a quiet run costs a few wake-ups a second. Two rows the
# user commits within one look leave one of them unridden.
POLL_MIN_S = 0.001
POLL_FAST_FOR_S = 0.25
POLL_MAX_S = 0.05
PLACER_JOIN_S = 5.0


class RowPlacer:
    """The steps waiting for a user row, the thread that places them, and the count of those
    dropped for want of one (``coalesced``, published under ``coalesced_key``)."""

    def __init__(self, row: Callable[[StepRecord], dict[str, Any]], coalesced_key: str) -> None:
        self._row = row
        self.coalesced_key = coalesced_key
        self._run: Run | None = None  # set with the first steps queued
        self._staged_at: int | None = None  # W&B row that may hold our last staged step
        self._pending: deque[StepRecord] = deque()
        self._changed = threading.Condition()
        self._placing = False  # a step taken from _pending is being logged
        self._blocked = False  # the open row holds our step: waiting for the user
        self._stopping = False
        # Started here, in the caller's thread, not lazily in the one calling write(): a
        # new thread inherits its creator's scheduling priority, and gradtrack's delivery
        # threads yield to training, while riding the user's rows needs a prompt look
        # (measured under load: 452 of 600 rows ridden at normal priority, 354 at nice 10).
        # It only wakes to look for a row while steps wait, so the training loop loses little.
        self._placer = threading.Thread(
            target=self._place_loop, name="gradtrack-wandb-rows", daemon=True
        )
        self.error: BaseException | None = None
        self._waiting_since: float | None = None  # when the placer began to wait for a row
        self.coalesced = 0  # steps dropped for want of a user row
        self._coalesced_published = 0
        self._warned_coalesced = False
        self._placer.start()

    def enqueue(self, run: Run, batch: Sequence[StepRecord]) -> None:
        with self._changed:
            self._run = run
            self._pending.extend(batch)
            while len(self._pending) > PENDING_LIMIT:
                self._pending.popleft()
                self.coalesced += 1
            self._blocked = False
            self._changed.notify_all()

    def waiting(self) -> bool:
        """Steps still wait for a row."""
        return bool(self._pending)

    def _place_loop(self) -> None:
        try:
            while self._place_next():
                pass
        except Exception as error:  # reported by the next write, so the worker counts it
            self.error = error
        finally:
            with self._changed:
                self._placing = False
                self._blocked = True  # nothing moves any more: let flush() return
                self._changed.notify_all()

    def _place_next(self) -> bool:
        """Stage the oldest waiting step once the open row holds none of ours; False: stop."""
        with self._changed:
            self._changed.wait_for(lambda: self._stopping or bool(self._pending))
            if self._stopping:
                return False
        run = self._run  # set before the first step was queued
        assert run is not None
        if finished(run):
            return False
        if self._holds_ours(run):
            with self._changed:  # the open row may hold our last step: wait for the user's next
                self._blocked = True
                self._changed.notify_all()
            time.sleep(self._poll_interval())
            return True
        self._waiting_since = None
        with self._changed:
            record = self._pending.popleft()
            self._placing = True
        run.log(self._row(record), commit=False)
        # Had the user committed meanwhile, our step could be in either row; taking W&B's
        # open row now (asked after our log, in order) means we never overwrite it.
        staged_at = run.step
        with self._changed:
            self._staged_at = staged_at
            self._placing = False
            self._changed.notify_all()
        return True

    def _poll_interval(self) -> float:
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        waited = now - self._waiting_since
        if waited < POLL_FAST_FOR_S:
            return POLL_MIN_S
        return min(POLL_MAX_S, POLL_MIN_S * 2 ** ((waited - POLL_FAST_FOR_S) / 0.05))

    def _holds_ours(self, run: Run) -> bool:
        """Whether the open row may still hold our last staged step.

        ``_staged_at`` is W&B's own count, asked after our log, and can run ahead of the
        SDK's ``_local_step`` while the user's ``log`` is between sending its row and
        counting it. Only a count past ``_staged_at`` proves the user committed a row after
        ours, so anything else counts as "may hold ours".
        """
        return self._staged_at is not None and next_row(run) <= self._staged_at

    def flush(self, timeout_s: float) -> None:
        """Wait (bounded) until every waiting step rides a row, or waits for the user's next."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._blocked or not (self._pending or self._placing),
                timeout=timeout_s,
            )

    def stop(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        if self._placer.is_alive():
            self._placer.join(PLACER_JOIN_S)

    def drop_waiting(self) -> None:
        """The run is gone: the waiting steps are counted as coalesced."""
        with self._changed:
            self.coalesced += len(self._pending)
            self._pending.clear()

    def place_the_rest(self, run: Run) -> None:
        """The steps still waiting, in rows of their own: only once nobody else can log
        (the run is finishing, or the interpreter exits), so no one's steps move."""
        with self._changed:
            rest = list(self._pending)
            self._pending.clear()
        for record in rest:
            if self._holds_ours(run):
                run.log({}, commit=True)  # commit the row holding our previous step
            run.log(self._row(record), commit=False)
            self._staged_at = next_row(run)

    def publish_coalesced(self, run: Run) -> None:
        if self.coalesced != self._coalesced_published:
            self._coalesced_published = self.coalesced
            run.summary[self.coalesced_key] = self.coalesced

    def warn_coalesced(self) -> None:
        if self.coalesced and not self._warned_coalesced:
            self._warned_coalesced = True
            warnings.warn(
                f"gradtrack left {self.coalesced} steps out of the W&B run (summary "
                f"{self.coalesced_key}): in a run you log to, each of gradtrack's steps rides "
                f"one of your rows, and more than {PENDING_LIMIT} waited for one. Log to W&B "
                "at least as often as gradtrack logs (log_every), or let gradtrack start the "
                "run",
                RuntimeWarning,
                stacklevel=2,
            )
