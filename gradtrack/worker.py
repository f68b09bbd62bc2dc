"""The worker thread: turns collected steps into `StepRecord`s and hands them to the sinks.

Between the training thread and the worker sits a bounded mailbox; the training thread never
waits on a sink, and a failing sink is reported once and never stops the others.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from gradtrack.collect import Collector
from gradtrack.histogram import Histogram, bin_samples
from gradtrack.record import StepRecord, summarise_layers
from gradtrack.sinks.base import GradientSink
from gradtrack.stats import HostPart

logger = logging.getLogger("gradtrack")


@dataclass
class PendingStep:
    """A step as the training thread left it: device work launched, copies in flight."""

    step: int
    wall_time: float
    parts: list[HostPart]


@dataclass
class _Control:
    kind: Literal["flush", "stop"]
    done: threading.Event = field(default_factory=threading.Event)


_Item = PendingStep | _Control


class Mailbox:
    """A bounded queue of steps; control messages (flush, stop) never count against the bound."""

    def __init__(self, capacity: int, when_full: Literal["drop_oldest", "block"]) -> None:
        self.capacity = capacity
        self.when_full = when_full
        self.dropped = 0
        self._items: deque[_Item] = deque()
        self._steps = 0
        self._changed = threading.Condition()

    def put_step(self, item: PendingStep) -> None:
        with self._changed:
            if self.when_full == "block":
                self._changed.wait_for(lambda: self._steps < self.capacity)
            while self._steps >= self.capacity:
                oldest = next(i for i, x in enumerate(self._items) if isinstance(x, PendingStep))
                del self._items[oldest]
                self._steps -= 1
                self.dropped += 1
            self._items.append(item)
            self._steps += 1
            self._changed.notify_all()

    def put_control(self, item: _Control) -> None:
        with self._changed:
            self._items.append(item)
            self._changed.notify_all()

    def take(self, max_steps: int) -> list[_Item]:
        """Wait for work; return up to ``max_steps`` steps, stopping after a control message."""
        with self._changed:
            self._changed.wait_for(lambda: bool(self._items))
            taken: list[_Item] = []
            while self._items and len(taken) < max_steps:
                item = self._items.popleft()
                taken.append(item)
                if isinstance(item, _Control):
                    break
                self._steps -= 1
            self._changed.notify_all()
            return taken


class Worker:
    """Owns the sinks; every sink call happens on this thread."""

    def __init__(
        self,
        collector: Collector,
        sinks: Sequence[GradientSink],
        mailbox: Mailbox,
        hist_bins: int,
        max_batch_steps: int,
    ) -> None:
        self.sinks = list(sinks)
        self.sink_errors = [0] * len(self.sinks)
        self.record_errors = 0
        self._collector = collector
        self._mailbox = mailbox
        self._hist_bins = hist_bins
        self._max_batch_steps = max_batch_steps
        self._thread = threading.Thread(target=self._run, name="gradtrack-worker", daemon=True)
        self._thread.start()

    def request(self, kind: Literal["flush", "stop"], timeout_s: float) -> bool:
        """Ask the worker to flush (or flush and close) the sinks; False if it took too long."""
        if not self._thread.is_alive():
            return True
        control = _Control(kind)
        self._mailbox.put_control(control)
        return control.done.wait(timeout_s)

    def _run(self) -> None:
        while True:
            records: list[StepRecord] = []
            for item in self._mailbox.take(self._max_batch_steps):
                if isinstance(item, PendingStep):
                    record = self._build_guarded(item)
                    if record is not None:
                        records.append(record)
                    continue
                self._deliver("write", records)
                records = []
                self._deliver("flush")
                if item.kind == "stop":
                    self._deliver("close")
                    item.done.set()
                    return
                item.done.set()
            self._deliver("write", records)

    def _build_guarded(self, pending: PendingStep) -> StepRecord | None:
        try:
            return self.build_record(pending)
        except Exception as exc:  # a bug here must not stop the worker
            self.record_errors += 1
            if self.record_errors == 1:
                _report(f"gradtrack could not summarise step {pending.step}: {exc!r}")
            return None

    def build_record(self, pending: PendingStep) -> StepRecord:
        for part in pending.parts:
            part.wait()
        collector = self._collector
        index = np.concatenate([part.tensor_index for part in pending.parts])
        layers, stats, total_norm = summarise_layers(
            collector.layer_names,
            collector.tensor_layer[index],
            collector.tensor_numel[index],
            np.concatenate([part.stats() for part in pending.parts]),
        )
        return StepRecord(
            step=pending.step,
            wall_time=pending.wall_time,
            layers=layers,
            stats=stats,
            total_norm=total_norm,
            histograms=self._histograms(pending.parts),
        )

    def _histograms(self, parts: Sequence[HostPart]) -> dict[str, Histogram]:
        per_layer: dict[int, list[np.ndarray]] = {}
        for part in parts:
            if part.sample_counts is None:
                continue
            layer_of = self._collector.tensor_layer[part.tensor_index]
            pieces = np.split(part.samples(), np.cumsum(part.sample_counts)[:-1])
            for layer, piece in zip(layer_of.tolist(), pieces):
                per_layer.setdefault(layer, []).append(piece)
        histograms = {}
        for layer, pieces in sorted(per_layer.items()):
            histogram = bin_samples(np.concatenate(pieces), self._hist_bins)
            if histogram is not None:
                histograms[self._collector.layer_names[layer]] = histogram
        return histograms

    def _deliver(self, method: str, records: Sequence[StepRecord] = ()) -> None:
        if method == "write" and not records:
            return
        for i, sink in enumerate(self.sinks):
            try:
                getattr(sink, method)(*((records,) if method == "write" else ()))
            except Exception as exc:  # one broken sink must not stop the others
                self.sink_errors[i] += 1
                if self.sink_errors[i] == 1:
                    _report(
                        f"gradtrack sink {type(sink).__name__}.{method} failed: {exc!r}; "
                        "training and the other sinks go on, further errors are only counted"
                    )


def _report(message: str) -> None:
    logger.warning(message)
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    except Exception:  # warnings turned into errors must not kill the worker thread
        pass
