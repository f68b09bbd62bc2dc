"""The bounded queue between the training thread and the worker: steps, bounded in count and
bytes (the oldest dropped and counted, or the trainer made to wait), and control messages."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from gradtrack.config import DeliveryOptions
from gradtrack.handoff.drops import DropCount
from gradtrack.handoff.pending import PendingStep, UpdateFollowUp
from gradtrack.lifecycle import Outcome


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
        return 0 if item.update is None else item.update[0].nbytes
    return sum(
        part.buffer.nbytes + (0 if part.cpu_samples is None else part.cpu_samples.nbytes)
        for part in item.parts
    )


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
        self._urgent = False  # a step waits for the worker's answer: no gathering
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
                self._drop("gradtrack's worker thread has stopped")
                return
            while self._steps and self._full(size):
                oldest = next(i for i, x in enumerate(self._items) if not isinstance(x, Control))
                self._bytes -= _nbytes(self._items[oldest])  # type: ignore[arg-type]
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
            self._urgent |= isinstance(item, PendingStep) and item.reply is not None
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
            self._steps = self._bytes = 0
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
            self._changed.notify_all()

    def take(self, max_steps: int, gather_s: float = 0.0) -> list[QueuedItem]:
        """Wait for work; return up to ``max_steps`` steps, stopping after a control message.

        Once a step is waiting, wait up to ``gather_s`` more for others to join it (unless a
        control message or a full batch arrives): fewer, larger hand-offs.
        """
        with self._changed:
            self._changed.wait_for(lambda: bool(self._items))
            if gather_s > 0:
                self._changed.wait_for(lambda: self._ready(max_steps), timeout=gather_s)
            taken: list[QueuedItem] = []
            while self._items and len(taken) < max_steps:
                item = self._items.popleft()
                taken.append(item)
                if isinstance(item, Control):
                    break
                self._steps -= 1
                self._bytes -= _nbytes(item)
            self._urgent = any(isinstance(i, PendingStep) and i.reply for i in self._items)
            self._changed.notify_all()
            return taken

    def _ready(self, max_steps: int) -> bool:
        return (
            self._urgent
            or self._steps >= max_steps
            or any(isinstance(i, Control) for i in self._items)
        )
