"""The hand-off between the training thread and the worker: the bounded queue between them
(`Mailbox`: steps, bounded in count and bytes, the oldest dropped and counted or the trainer
made to wait, and control messages), what goes through it — a step as the training thread
left it (`PendingStep`), the update a judged step then applied (`UpdateFollowUp`), flush and
stop (`Control`) — the worker's one answer back (`Reply`), and the count of steps lost on
the way to the trackers (`DropCount`)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from gradtrack.config import DeliveryOptions
from gradtrack.formats.event import AlertEvent
from gradtrack.handoff.layout import FlatUpdate, HostPart
from gradtrack.lifecycle import Outcome

# `UpdateProbe.after`'s per-tensor rows on the host, and their copy's event; or a small CPU
# model's weights around the step, for the worker to reduce (`FlatUpdate`).
UpdateRows = tuple[Tensor, torch.cuda.Event | None] | FlatUpdate


@dataclass
class PendingStep:
    """A step as the training thread left it: device work launched, copies in flight."""

    step: int
    wall_time: float
    parts: list[HostPart]
    backward_order: list[int] | None = None  # layer indices, once learnt
    activation_order: list[int] | None = None  # activation modules, as their grads arrived
    # Sinks write its per-layer metrics (``layer_every``), and max/mean |g| were computed.
    per_layer: bool = True
    # A non-finite step: `StepRecord` fields from `gradtrack.capture.origin` (where it was made).
    origin: dict[str, Any] | None = None
    # With ``update_signals``: the update its optimizer step applied (`UpdateRows`).
    update: UpdateRows | None = None
    # The rule whose action "skip" left this step's optimizer step out; skips so far.
    skipped_by: str | None = None
    skipped_steps: int = 0
    # The closing step's flight recorder rows (a logged step's ride in its evidence).
    flight_rows: np.ndarray | None = None
    # The closing step's: how training ended where that was an exception or Ctrl-C, and the
    # bad step the accelerator's guard latched after the last logged step, read at close.
    ending: str | None = None
    latch: np.ndarray | None = None
    # The noise scale's: the step's examples counted (0: not) and its backward passes.
    batch: tuple[int, int] = (0, 1)
    # A raise rule judges it before its optimizer step: the worker answers here.
    reply: Reply | None = None
    # Its update signals follow once the optimizer step ran (an `UpdateFollowUp`).
    expects_update: bool = False


class Reply:
    """The worker's judgement of one step a raise rule waits for: the first event whose rule
    raises (None: none does), or that it could not judge the step."""

    def __init__(self) -> None:
        self.event: AlertEvent | None = None
        self.judged = False
        self._done = threading.Event()

    def answer(self, event: AlertEvent | None) -> None:
        self.event, self.judged = event, True
        self._done.set()

    def fail(self) -> None:
        self._done.set()

    def wait(self, timeout_s: float, gone: Callable[[], bool]) -> bool:
        """Wait for the answer, no longer than ``timeout_s`` and not once ``gone()`` says the
        worker stopped; True if the step was judged."""
        deadline = time.monotonic() + timeout_s
        while not self._done.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            if gone() or time.monotonic() >= deadline:
                break
        return self.judged


@dataclass
class UpdateFollowUp:
    """The update a judged step's optimizer step applied (None: it did not run), for the
    worker to add to that step's record before it is delivered."""

    step: int
    update: UpdateRows | None = field(default=None)


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

    def count(self, n: int) -> None:
        """Add ``n`` steps whose loss was told where it happened: in the other process of a
        watch whose worker runs apart (`gradtrack.worker.process`)."""
        with self._lock:
            self.total += n


@dataclass
class Control:
    kind: Literal["flush", "stop"]
    outcome: Outcome = "FINISHED"
    done: threading.Event = field(default_factory=threading.Event)


QueuedStep = PendingStep | UpdateFollowUp
QueuedItem = QueuedStep | Control


def _nbytes(item: QueuedStep) -> int:
    """Memory a queued step holds (its host copies and samples; an update's rows)."""
    if isinstance(item, UpdateFollowUp):
        update = item.update
        if update is None:
            return 0
        return update.nbytes if isinstance(update, FlatUpdate) else update[0].nbytes
    return sum(part.nbytes for part in item.parts)


def _waits(item: QueuedItem) -> bool:
    """Whether ``item`` is a step whose verdict the training thread waits for."""
    return isinstance(item, PendingStep) and item.reply is not None


class Mailbox:
    """A queue of steps bounded in count and in bytes; control messages (flush, stop) never
    count against the bounds."""

    def __init__(
        self,
        capacity: int,
        when_full: Literal["drop_oldest", "block"],
        drops: DropCount | None = None,
        max_bytes: int = 1 << 62,
    ) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.when_full = when_full
        self.dropped = 0
        self._drops = drops
        self._items: deque[QueuedItem] = deque()
        self._steps = 0
        self._bytes = 0
        self._closed = False
        # Counted as they come and go, not found by a scan: a worker behind the loop holds
        # thousands of steps, and a scan at every take made catching up cost more the
        # further behind it was.
        self._replies = 0  # steps waiting for the worker's answer: no gathering
        self._controls = 0  # control messages waiting
        # What the taker waits for: None (not waiting), 0 (anything), or a batch of that many
        # steps. A step put wakes it only where it would act: waking a thread to find it must
        # wait on costs the training thread the GIL at every logged step.
        self._taker: int | None = None
        self.taken = 0  # steps (not their follow-ups) taken so far
        self._changed = threading.Condition()

    @classmethod
    def for_options(cls, options: DeliveryOptions, drops: DropCount | None = None) -> Mailbox:
        return cls(options.queue_size, options.queue_full, drops, options.queue_mib << 20)

    def put_step(self, item: QueuedStep) -> None:
        with self._changed:
            size = _nbytes(item)
            if self.when_full == "block":
                self._changed.wait_for(lambda: self._closed or not self._full(size))
            if self._closed:  # the worker is gone: nothing would ever take it
                self._drop("gradtrack's worker has stopped")
                return
            while self._steps and self._full(size):
                oldest = next(i for i, x in enumerate(self._items) if not isinstance(x, Control))
                dropped = self._items[oldest]
                self._bytes -= _nbytes(dropped)  # type: ignore[arg-type]
                self._replies -= _waits(dropped)
                del self._items[oldest]
                self._steps -= 1
                self._drop(
                    f"the worker is {self._steps + 1} steps behind the training loop (raise "
                    "log_every, delivery.queue_size or delivery.queue_mib, or set "
                    "delivery.queue_full='block' to wait)"
                )
            self._items.append(item)
            self._steps += 1
            self._bytes += size
            self._replies += _waits(item)
            taker = self._taker  # (a control message wakes it whenever it is put)
            if taker is not None and (taker == 0 or self._replies or self._steps >= taker):
                self._changed.notify_all()

    def _full(self, adding_bytes: int) -> bool:
        return self._steps >= self.capacity or self._bytes + adding_bytes > self.max_bytes

    def _drop(self, why: str) -> None:
        self.dropped += 1
        if self._drops is not None:
            self._drops.add(1, why)

    def close(self) -> None:
        """No one takes from it any more: release anyone waiting for room."""
        with self._changed:
            self._closed = True
            self._items.clear()
            self._steps = self._bytes = self._replies = self._controls = 0
            self._changed.notify_all()

    @property
    def closed(self) -> bool:
        """The worker stopped taking from it."""
        return self._closed

    def __len__(self) -> int:
        """Steps waiting for the worker."""
        return self._steps

    def put_control(self, item: Control) -> None:
        with self._changed:
            self._items.append(item)
            self._controls += 1
            self._changed.notify_all()

    def take(self, max_steps: int, gather_s: float = 0.0) -> list[QueuedItem]:
        """Wait for work; return up to ``max_steps`` steps, stopping after a control message
        (none once the mailbox is closed).

        Once a step is waiting, wait up to ``gather_s`` more for others to join it (unless a
        control message, a step waiting for its verdict, or a full batch arrives): fewer,
        larger hand-offs, and the taker woken once per batch rather than once per step.
        """
        with self._changed:
            self._taker = 0
            self._changed.wait_for(lambda: bool(self._items) or self._closed)
            if gather_s > 0:
                self._taker = max_steps
                self._changed.wait_for(
                    lambda: self._closed or self._ready(max_steps), timeout=gather_s
                )
            self._taker = None
            taken: list[QueuedItem] = []
            while self._items and len(taken) < max_steps:
                item = self._items.popleft()
                taken.append(item)
                if isinstance(item, Control):
                    self._controls -= 1
                    break
                self._steps -= 1
                self.taken += isinstance(item, PendingStep)
                self._bytes -= _nbytes(item)
                self._replies -= _waits(item)
            self._changed.notify_all()
            return taken

    def _ready(self, max_steps: int) -> bool:
        return bool(self._replies or self._controls) or self._steps >= max_steps
