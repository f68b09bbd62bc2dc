"""The flight recorder: its ring on the training thread, the window the worker sends at each
kind of incident (non-finite on the accelerator's path, a skip, a raise, an exception,
Ctrl-C), once, and the first mover it names."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.capture.flight_ring import HOST_VALUES, FlightRecorder
from gradtrack.delivery.spool import decode, encode
from gradtrack.errors import GradientAlertError
from gradtrack.formats.flight import FlightWindow, read_window, window_text
from gradtrack.sinks import MemorySink
from gradtrack.worker.flight_log import FlightLog, first_mover
from tests.test_no_sync import OpRecorder


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )


def train(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, nan_at: int | None = None,
    stop_at: int | None = None, error: type[BaseException] = ValueError,
) -> None:  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(16, 8, generator=generator)
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        (loss * float("nan") if step == nan_at else loss).backward()
        optimizer.step()
        if step == stop_at:
            raise error("training broke")


def windows(sink: MemorySink) -> list[FlightWindow]:
    return [r.flight for r in sink.records if r.flight is not None]


def rows_of(taken: torch.Tensor | list[float] | None, n_layers: int) -> torch.Tensor:
    """The rows `FlightRecorder.take` handed on (a flat tensor, or host floats), one a step."""
    assert taken is not None
    return torch.as_tensor(taken, dtype=torch.float64).reshape(-1, 1 + n_layers)


def steps_of(taken: torch.Tensor | list[float] | None, n_layers: int) -> list[int]:
    return rows_of(taken, n_layers)[:, 0].long().tolist()


def test_rows_kept_on_the_host_and_written_in_keep_their_order_past_the_capacity() -> None:
    """A CPU model's quiet steps keep their rows in a list until the ring is read or full;
    read with rows written directly between them, the ring holds the last steps in order."""
    recorder = FlightRecorder(capacity=4, n_layers=1)
    taken: list[int] = []
    for step in range(23):
        if step % 5 == 0:  # (a logged step: written directly)
            recorder.record(step, torch.tensor([9.0, step], dtype=torch.float64))
        else:
            recorder.record_host(step, [9.0, float(step)])
        if step in (3, 9, 13, 14, 18):  # (14: read while only kept rows are new)
            rows = recorder.take()
            assert rows_of(rows, 1)[:, 1].tolist() == steps_of(rows, 1)
            taken += steps_of(rows, 1)
    taken += steps_of(recorder.take(), 1)
    assert taken == [0, 1, 2, 3, *range(6, 23)]

    for step in (23, 24):  # read after each (a step logged at every step): one row each
        norms = [9.0, float(step) + 0.5]
        recorder.record_host(step, norms)
        rows = recorder.take()
        assert rows == [step, step + 0.5]  # (host floats: no tensor made for one row)
        assert norms == [9.0, step + 0.5]  # (the caller's norms untouched)
    assert recorder.take() is None


def test_many_rows_kept_on_the_host_are_handed_on_as_one_tensor() -> None:
    """Past `HOST_VALUES` numbers the kept rows come as one float64 tensor (numpy fills it
    faster than a Python list grows), in the same order as the few that come as floats."""
    n_layers = 3
    per_row = 1 + n_layers
    recorder = FlightRecorder(capacity=HOST_VALUES, n_layers=n_layers)
    recorder.record(0, torch.zeros(per_row, dtype=torch.float64))  # (the ring, on the CPU)
    recorder.take()
    few = HOST_VALUES // per_row
    for rows_kept, kind in ((few, list), (few + 1, torch.Tensor)):
        first = recorder._written
        for step in range(first, first + rows_kept):
            recorder.record_host(step, [0.0, *(step + layer / 10 for layer in range(n_layers))])
        taken = recorder.take()
        assert isinstance(taken, kind)
        assert steps_of(taken, n_layers) == list(range(first, first + rows_kept))
        assert rows_of(taken, n_layers)[:, 2].tolist() == [
            step + 0.1 for step in range(first, first + rows_kept)
        ]


def test_the_ring_keeps_the_last_k_steps_and_hands_each_on_once() -> None:
    recorder = FlightRecorder(capacity=5, n_layers=3)
    assert recorder.nbytes == 5 * 4 * 8
    for step in range(12):
        recorder.record(step, torch.tensor([0.0, step, 2.0 * step, -1.0], dtype=torch.float64))
        if step == 3:
            assert steps_of(recorder.take(), 3) == [0, 1, 2, 3]
    rows = recorder.take()
    assert steps_of(rows, 3) == [7, 8, 9, 10, 11]  # 4..6 fell out of the ring before a take
    assert rows is not None and rows.reshape(5, 4)[:, 2].tolist() == [14, 16, 18, 20, 22]
    assert recorder.take() is None


def test_a_held_ring_keeps_the_rows_up_to_the_latched_step() -> None:
    recorder, held = FlightRecorder(capacity=4, n_layers=1), torch.tensor(True)
    for step in range(10):
        hold = held if step > 5 else torch.tensor(False)  # latched at step 5
        recorder.record(step, torch.tensor([0.0, step], dtype=torch.float64), hold=hold)
    assert steps_of(recorder.take(), 1) == [2, 3, 4, 5]
    log = FlightLog(("a",), steps=3, slack=0, action=lambda rule, layer: "warn")
    log.add(np.array([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]).reshape(-1))
    log.add(np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]).reshape(-1))  # 1, 2 again: dropped
    window = log.window("nonfinite", 3)
    assert window is not None and window.steps.tolist() == [0, 1, 2, 3]


def test_the_accelerators_path_keeps_k_steps_before_a_latched_nan_without_a_host_read() -> None:
    model, sink, ops = mlp(), MemorySink(), OpRecorder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, flight={"steps": 64}) as w:
        w.guard_reads_host = False
        w.collector.foreach_only = True
        with ops:
            train(model, optimizer, 120, nan_at=97)
    assert ops.ops["_local_scalar_dense"] == 0
    (window,) = [w for w in windows(sink) if w.incident == "nonfinite"]
    assert window.incident_step == 97  # found at step 100, the next logged one
    assert window.steps.tolist() == list(range(97 - 64, 98))
    assert np.isfinite(window.norms[:-1]).all() and np.isnan(window.norms[-1]).all()


@pytest.mark.parametrize("log_every", [300, 10**9])  # past the window; the benchmark's "never"
def test_a_latched_nan_far_from_a_logged_step_keeps_a_bounded_host_copy(log_every: int) -> None:
    model, sink = mlp(), MemorySink()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    options = {"log_every": log_every, "histograms": False, "flight": {"steps": 64}}
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, **options) as w:
        w.guard_reads_host = False
        w.collector.foreach_only = True
        flight = w.worker.assembler.flight  # (a memory sink: the worker is a thread)
        assert flight is not None and flight.capacity <= 2 * 64 + 1  # not log_every's steps
        train(model, optimizer, 250, nan_at=197)
    (window,) = [w for w in windows(sink) if w.incident == "nonfinite"]
    assert window.incident_step == 197  # read at step 300, or at the end of training
    assert window.steps.tolist() == list(range(197 - 64, 198))
    assert np.isfinite(window.norms[:-1]).all() and np.isnan(window.norms[-1]).all()


def test_a_skipped_step_sends_its_window(tmp_path: Path) -> None:
    model, sink = mlp(), MemorySink()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    skip, flight = {"nonfinite": {"action": "skip"}}, {"steps": 32}
    journal = {"journal": tmp_path / "skipped.json"}
    with gradtrack.watch(
        model, backend=sink, optimizer=optimizer, alerts=skip, flight=flight, skip=journal
    ):
        train(model, optimizer, 60, nan_at=45)
    (window,) = windows(sink)
    assert window.incident_step == 45 and window.steps.tolist() == list(range(13, 46))


def test_a_raise_sends_the_window_once_and_the_exception_that_follows_none() -> None:
    model, sink = mlp(), MemorySink()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(GradientAlertError):
        with gradtrack.watch(model, backend=sink, optimizer=optimizer,
                             alerts={"nonfinite": {"action": "raise"}}):  # fmt: skip
            train(model, optimizer, 60, nan_at=45)
    (window,) = windows(sink)
    assert window.incident == "nonfinite" and window.steps.tolist() == list(range(46))


@pytest.mark.parametrize(
    ("error", "outcome"), [(ValueError, "FAILED"), (KeyboardInterrupt, "KILLED")]
)
def test_training_that_ends_in_an_exception_sends_the_steps_before_it(
    error: type[BaseException], outcome: str
) -> None:
    model, sink = mlp(), MemorySink()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(error):
        with gradtrack.watch(model, backend=sink, optimizer=optimizer, flight={"steps": 100}):
            train(model, optimizer, 300, stop_at=233, error=error)
    (record,) = [r for r in sink.records if r.flight is not None]
    assert record.window_only and record.step == 233 and record.flight is not None
    assert record.flight.incident == outcome
    assert record.flight.steps.tolist() == list(range(133, 234))
    assert sink.scalars()["grad/total_norm"][-1][0] == 230  # no metrics at the window's record


def test_a_run_that_ends_well_sends_no_window() -> None:
    model, sink = mlp(), MemorySink()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradtrack.watch(model, backend=sink, optimizer=optimizer):
        train(model, optimizer, 80)
    assert windows(sink) == []


def test_off_there_is_no_ring_and_no_window() -> None:
    model, sink = mlp(), MemorySink()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, flight={"enabled": False}) as w:
        train(model, optimizer, 60, nan_at=45)
        assert w.judge.signals.flight is None
    assert windows(sink) == []


def test_a_window_goes_out_once_per_kind_and_its_steps_once_as_series() -> None:
    def rows(steps: range) -> np.ndarray:
        return np.column_stack([steps, np.ones((len(steps), 2))]).reshape(-1)

    log = FlightLog(("a", "b"), steps=10, slack=5, action=lambda rule, layer: "warn")
    log.add(rows(range(21)))
    first = log.window("spike", 20)
    assert first is not None and first.steps.tolist() == list(range(10, 21))
    log.add(rows(range(21, 30)))  # the ring holds 16 steps: 14..29
    assert log.window("spike", 25) is None  # the same kind within 10 steps
    second = log.window("nonfinite", 25)
    assert second is not None and second.steps.tolist() == list(range(15, 26))
    assert second.logged.tolist() == [True] * 6 + [False] * 5  # 15..20 went out already
    assert log.window("FAILED", 29) is None  # the end of training, right after: nothing new


def test_stationary_noise_has_no_first_mover_and_a_falling_layer_is_one() -> None:
    rng = np.random.default_rng(3)
    norms = 10 ** rng.normal(0, 0.05, (257, 40))
    assert first_mover(np.arange(257), norms, 256) is None
    norms[220:, 17] /= 1.15 ** np.arange(1, 38)
    move = first_mover(np.arange(257), norms, 256)
    assert move is not None and move.layer == 17 and move.direction == "falling"
    assert 218 <= move.step <= 224


def test_a_window_survives_the_spool_and_its_file() -> None:
    window = FlightWindow(
        "nonfinite", 9, ("a", "b"), np.arange(8, 10), np.array([[1, 2], [np.nan, 3]], np.float32),
        np.array([True, False]), "a", 8, "rising", "a moved",
    )  # fmt: skip
    record = gradtrack.StepRecord(9, 0.0, ("a",), np.zeros((1, 7)), 1.0, flight=window)
    for back in (decode(encode(record)).flight, read_window(window_text(window))):  # type: ignore[union-attr]
        assert back is not None and back.layers == window.layers
        assert back.steps.tolist() == [8, 9] and back.logged.tolist() == [True, False]
        np.testing.assert_array_equal(back.norms, window.norms)
        assert (back.first_mover, back.first_mover_step, back.message) == ("a", 8, "a moved")
