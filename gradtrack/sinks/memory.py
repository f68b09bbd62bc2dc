"""A sink that keeps every step in process: for notebooks, tests and custom analysis.

`scalars()` and `histograms()` give the same keys every other sink logs.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from gradtrack.formats.event import AlertEvent
from gradtrack.formats.histogram import Histogram
from gradtrack.formats.metrics import scalar_metrics, window_series
from gradtrack.formats.record import StepRecord
from gradtrack.sinks.base import SinkBase


class MemorySink(SinkBase):
    """Stores every `StepRecord` it is given.

    >>> import torch, gradtrack
    >>> model = torch.nn.Linear(4, 2)
    >>> sink = MemorySink()
    >>> with gradtrack.watch(model, backend=sink, log_every=1):
    ...     model(torch.ones(3, 4)).sum().backward()
    >>> [step for step, _ in sink.scalars()["grad/total_norm"]]
    [0]
    """

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.events: list[AlertEvent] = []
        self.closed = False
        self._lock = threading.Lock()

    def write(self, batch: Sequence[StepRecord]) -> None:
        with self._lock:
            self.records.extend(batch)

    def alert(self, event: AlertEvent) -> None:
        with self._lock:
            self.events.append(event)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def scalars(self, windows: bool = False) -> dict[str, list[tuple[int, float]]]:
        """``{key: [(step, value), ...]}`` in step order; with ``windows``, the flight
        recorder's windows' ``grad_norm/<layer>`` steps too (what MLflow holds; a W&B run's
        step files hold the steps without them)."""
        series: dict[str, list[tuple[int, float]]] = {}
        with self._lock:
            records = list(self.records)
        sort = False
        for record in records:
            for key, value in scalar_metrics(record).items():
                series.setdefault(key, []).append((record.step, value))
            if windows and record.flight is not None:
                sort = True
                for key, value, step in window_series(record.flight, record.model_name):
                    series.setdefault(key, []).append((step, value))
        if sort:
            for values in series.values():
                values.sort(key=lambda entry: entry[0])
        return series

    def histograms(self) -> dict[str, list[tuple[int, Histogram]]]:
        """``{layer: [(step, Histogram), ...]}`` for the steps that sampled gradients."""
        series: dict[str, list[tuple[int, Histogram]]] = {}
        with self._lock:
            records = list(self.records)
        for record in records:
            for layer, histogram in record.histograms.items():
                series.setdefault(layer, []).append((record.step, histogram))
        return series
