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

from gradtrack.delivery.courier import GiveWay, SpooledCourier
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


class TimedSink(TrackerSink):
    """Keeps when each item arrived."""

    batch_items = 1  # (each item due at once)
    histogram_steps = 0

    def __init__(self) -> None:
        self.arrived: dict[int, float] = {}

    def send(self, batch: Sequence[StepRecord | AlertEvent]) -> None:
        for item in batch:
            self.arrived[item.step] = time.monotonic()

    def send_histograms(self, records: Sequence[StepRecord]) -> None:
        raise AssertionError("no histograms here")

    def spool_target(self) -> dict[str, Any]:
        return {"backend": "timed"}


def test_a_trackers_writes_give_way_while_the_worker_is_behind(tmp_path: Path) -> None:
    """In a worker process that cannot keep up with both, the tracker's writes wait while
    steps wait for the worker — at most three times as long as its last send took, at least
    `GiveWay.FLOOR_S`, so it is never starved — and not at all once the worker caught up, or
    for a flush."""
    spool = Spool.create(tmp_path, "unit", {"0-TimedSink": {}}, 1 << 30)
    sink = TimedSink()
    behind = threading.Event()
    behind.set()
    give_way = GiveWay(lambda: 100 if behind.is_set() else 0, steps=64)  # (100 steps wait)
    courier = SpooledCourier(sink, spool, "0-TimedSink", lambda m: None, give_way=give_way)

    def deliver(step: int, within_s: float) -> float:
        spool.append([record(step)])
        courier.announce(spool.last_seq)
        start = time.monotonic()
        while step not in sink.arrived:
            assert time.monotonic() - start < within_s, f"step {step} not sent"
            time.sleep(0.005)
        return sink.arrived[step] - start

    assert deliver(0, within_s=10) < 1.0  # (its first send: nothing sent yet to give way to)
    waited = deliver(1, within_s=10)
    assert GiveWay.FLOOR_S - 0.1 < waited < GiveWay.FLOOR_S + 2  # (its sends take no time)
    behind.clear()
    time.sleep(0.1)
    assert deliver(2, within_s=10) < 0.5  # the worker caught up: at once
    behind.set()
    deliver(3, within_s=10)  # (a send: the next one would wait again)
    spool.append([record(4)])
    courier.announce(spool.last_seq)
    courier.post_after("flush", 30.0).wait(0.5)  # a flush does not give way
    assert 4 in sink.arrived
    courier.post_after("close", 30.0).wait(10)
    spool.close()


def test_a_tracker_that_gives_way_keeps_a_quarter_of_the_time() -> None:
    """After a send of 2 s (a batch of MLflow's metrics), the next waits up to 6 s while the
    worker is behind, so the tracker keeps a quarter of the time; none once it caught up."""
    waiting = [100]
    give_way = GiveWay(lambda: waiting[0], steps=64)
    now = time.monotonic()
    assert give_way.wait_s(last_sent=now - 5.0, send_s=2.0) == GiveWay.WAIT_S
    assert give_way.wait_s(last_sent=now - 6.5, send_s=2.0) is None
    assert give_way.wait_s(last_sent=now - 0.5, send_s=0.0) == GiveWay.WAIT_S  # (the floor)
    assert give_way.wait_s(last_sent=now - 1.5, send_s=0.0) is None
    waiting[0] = 64  # (two batches: not behind)
    assert give_way.wait_s(last_sent=now - 5.0, send_s=2.0) is None
