"""The sink/courier seam with a `TrackerSink` of the user's own: every item reaches `send`
once and in order however often a send fails, histograms go on their own cursor, and a
flush waits for both."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gradtrack.delivery.courier import SpooledCourier
from gradtrack.delivery.spool import Spool
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.histogram import bin_samples
from gradtrack.formats.record import StepRecord
from gradtrack.sinks import TrackerSink


def record(step: int, histogram: bool = False) -> StepRecord:
    histograms = {"a": bin_samples(np.arange(10.0), 4)} if histogram else {}
    return StepRecord(step, float(step), ("a",), np.ones((1, 7)), 1.0, histograms=histograms)


class FlakySink(TrackerSink):
    """Stores in lists; every other call fails first (as a server that drops requests)."""

    batch_items = 7
    histogram_steps = 3
    histogram_wait_s = 0.005  # short chunks, while more histograms keep coming
    retry_max_s = 0.02

    def __init__(self) -> None:
        self.items: list[int | str] = []
        self.histograms: list[int] = []
        self.calls = 0
        self.lock = threading.Lock()

    def _maybe_fail(self) -> None:
        with self.lock:
            self.calls += 1
            if self.calls % 2 == 1:
                raise ConnectionError("dropped")

    def send(self, batch: Sequence[StepRecord | AlertEvent]) -> None:
        self._maybe_fail()
        self.items.extend(i.step if isinstance(i, StepRecord) else f"alert {i.step}" for i in batch)

    def send_histograms(self, records: Sequence[StepRecord]) -> None:
        self._maybe_fail()
        assert all(r.histograms for r in records)
        self.histograms.extend(r.step for r in records)

    def spool_target(self) -> dict[str, Any]:
        return {"backend": "flaky"}


def test_every_item_reaches_send_once_in_order_through_failures(tmp_path: Path) -> None:
    spool = Spool.create(tmp_path, "unit", {"0-FlakySink": {}}, 1 << 30)
    sink = FlakySink()
    courier = SpooledCourier(sink, spool, "0-FlakySink", lambda message: None)
    expected: list[int | str] = []
    for step in range(100):  # announced in small pieces while delivery retries
        items: list[StepRecord | AlertEvent] = [record(step, histogram=step % 10 == 0)]
        expected.append(step)
        if step % 33 == 5:
            items.append(AlertEvent(
                step=step, wall_time=0.0, rule="spike", layer="a", statistic="norm",
                value=1.0, threshold=0.5, severity="warning", message="spike",
            ))  # fmt: skip
            expected.append(f"alert {step}")
        spool.append(items)
        courier.announce(spool.last_seq)
        time.sleep(0.002)
    courier.post_after("flush", 30.0).wait(60)
    assert sink.items == expected  # each once, in order
    assert sink.histograms == list(range(0, 100, 10))  # each once, none passed over
    assert courier.failures > 0 and spool.undelivered() == 0
    courier.post_after("close", 30.0).wait(60)
    spool.close()
