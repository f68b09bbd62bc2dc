"""The declared sink contract: a plain `GradientSink` of the user's works end to end with
`SinkBase`'s defaults, every built-in sink derives from `SinkBase`, its optional parts are
called on the threads the docstrings name, and both couriers answer one interface."""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Sequence

import pytest
import torch
from torch import nn

import gradtrack
import gradtrack.sinks
from gradtrack.delivery.courier import Courier, SinkCourier, SpooledCourier
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord
from gradtrack.handoff.mailbox import DropCount
from gradtrack.sinks import MemorySink, SinkBase, TrackerSink, as_sink_base
from tests.conftest import NoUpdate


class PlainSink:
    """A user's sink: the protocol's four methods and nothing else; no base class."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.events: list[AlertEvent] = []
        self.calls: list[tuple[str, str]] = []  # (method, thread name)
        self.closes = 0

    def _called(self, method: str) -> None:
        self.calls.append((method, threading.current_thread().name))

    def write(self, batch: Sequence[StepRecord]) -> None:
        self._called("write")
        self.steps.extend(record.step for record in batch)

    def alert(self, event: AlertEvent) -> None:
        self._called("alert")
        self.events.append(event)

    def flush(self) -> None:
        self._called("flush")

    def close(self) -> None:
        self._called("close")
        self.closes += 1


def train(watcher_model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        watcher_model(torch.ones(2, 3)).sum().backward()
        optimizer.step()


def test_a_plain_sink_gets_every_step_on_its_courier_thread_and_is_closed_once() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    optimizer = NoUpdate(model.parameters())
    sink = PlainSink()
    assert isinstance(sink, gradtrack.GradientSink) and not isinstance(sink, SinkBase)
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, log_every=1) as watcher:
        train(model, optimizer, 4)
        assert watcher.flush()
        assert watcher.sinks == [sink] and watcher.sinks[0] is sink
    assert sink.steps == [0, 1, 2, 3] and sink.closes == 1
    assert sink.calls[-1][0] == "close" and watcher.sink_errors == {"0:PlainSink": 0}
    assert {thread for _, thread in sink.calls} == {"gradtrack-PlainSink"}


def test_a_plain_sink_from_register_sink_works_beside_a_built_in_one() -> None:
    made: list[PlainSink] = []

    def factory(config: gradtrack.GradtrackConfig) -> PlainSink:
        made.append(PlainSink())
        return made[-1]

    gradtrack.register_sink("test-plain", factory)
    model = nn.Linear(3, 1)
    optimizer = NoUpdate(model.parameters())
    memory = MemorySink()
    with gradtrack.watch(model, backend=["test-plain", memory], optimizer=optimizer, log_every=1):
        train(model, optimizer, 3)
    assert len(made) == 1 and made[0].steps == [0, 1, 2] and made[0].closes == 1
    assert [record.step for record in memory.records] == [0, 1, 2] and memory.closed


class Finishing(SinkBase):
    """A sink with the optional parts: which thread calls each, and the outcome at close."""

    def __init__(self) -> None:
        self.threads: dict[str, str] = {}
        self.outcome_at_close: str | None = None
        self.steps = 0

    def _called(self, method: str) -> None:
        self.threads.setdefault(method, threading.current_thread().name)

    def write(self, batch: Sequence[StepRecord]) -> None:
        self._called("write")
        self.steps += len(batch)

    def alert(self, event: AlertEvent) -> None:
        self._called("alert")

    def close(self) -> None:
        self._called("close")
        self.outcome_at_close = self.outcome

    def report_command(self) -> str | None:
        self._called("report_command")
        return "gradtrack report here"

    def end_shared_run(self) -> None:
        self._called("end_shared_run")


def test_the_optional_parts_are_called_on_the_threads_they_say() -> None:
    model = nn.Linear(3, 1)
    optimizer = NoUpdate(model.parameters())
    sink = Finishing()
    with pytest.raises(RuntimeError, match="training broke"):
        with gradtrack.watch(model, backend=sink, optimizer=optimizer, log_every=1):
            train(model, optimizer, 2)
            raise RuntimeError("training broke")
    assert sink.steps >= 2 and sink.outcome_at_close == "FAILED"
    main = threading.current_thread().name
    assert sink.threads == {
        "write": "gradtrack-Finishing",
        "close": "gradtrack-Finishing",
        "end_shared_run": main,
        "report_command": main,
    }


def _sink_classes() -> list[type]:
    """Every class in gradtrack.sinks' modules with a sink's methods (the protocol aside)."""
    classes = []
    for info in pkgutil.iter_modules(gradtrack.sinks.__path__):
        module = importlib.import_module(f"gradtrack.sinks.{info.name}")
        for value in vars(module).values():
            if isinstance(value, type) and value.__module__ == module.__name__:
                if value is gradtrack.GradientSink:
                    continue
                if all(callable(getattr(value, m, None)) for m in ("write", "alert", "close")):
                    classes.append(value)
    return classes


def test_every_built_in_sink_derives_from_the_base() -> None:
    classes = _sink_classes()
    names = {cls.__name__ for cls in classes}
    builtin = {"ConsoleSink", "MemorySink", "MlflowSink", "TensorboardSink", "WandbSink"}
    assert builtin <= names  # the scan finds them
    assert [cls.__name__ for cls in classes if not issubclass(cls, SinkBase)] == []
    assert issubclass(TrackerSink, SinkBase)


def test_the_base_declares_each_optional_part_with_a_no_op_default() -> None:
    sink = as_sink_base(PlainSink())
    assert sink.outcome == "FINISHED" and sink.report_command() is None
    assert sink.end_shared_run() is None
    sink.write([])
    sink.close()
    memory = MemorySink()
    assert as_sink_base(memory) is memory


def test_a_courier_without_a_spool_answers_the_spool_members() -> None:
    sink = PlainSink()
    courier = Courier(sink, capacity=10, drops=DropCount(print), on_error=print)
    assert isinstance(courier, SinkCourier) and issubclass(SpooledCourier, SinkCourier)
    assert courier.left == 0 and courier.starting is False
    courier.hand_over([], [])
    assert courier.request_flush(1.0).wait(10) and courier.request_close("KILLED", 1.0).wait(10)
    assert [method for method, _ in sink.calls] == ["flush", "close"]
