"""The off switch: ``GRADTRACK_DISABLED=1`` / ``enabled=False`` keep the ``watch`` line inert."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.api import NullWatcher, WatcherLike
from gradtrack.sinks import MemorySink
from gradtrack.watcher import Watcher
from tests.conftest import SmallCNN
from tests.test_watcher import hook_state, train


def test_gradtrack_disabled_adds_no_hook_writes_nothing_and_training_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GRADTRACK_DISABLED", "1")
    monkeypatch.chdir(tmp_path)  # where the MLflow sink's default store would appear
    torch.manual_seed(0)
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    before = hook_state(model, optimizer)
    sink = MemorySink()
    watcher = gradtrack.watch(model, backend=[sink, "mlflow"], optimizer=optimizer)
    assert hook_state(model, optimizer) == before
    losses = train(model, 25, optimizer)
    watcher.close()
    assert len(losses) == 25 and all(torch.isfinite(torch.tensor(losses)))
    assert sink.records == [] and sink.events == []
    assert watcher.sinks == [] and watcher.layer_names == ()
    assert os.listdir(tmp_path) == []  # no mlflow.db, no spool, no run folder
    gradtrack.watch(model, backend=sink).close()  # nothing was left registered


def test_enabled_false_in_code_switches_off_too() -> None:
    model = nn.Linear(3, 1)
    sink = MemorySink()
    with gradtrack.watch(model, backend=sink, enabled=False, log_every=1) as watcher:
        model(torch.randn(2, 3)).sum().backward()
    assert sink.records == [] and "off" in repr(watcher)


def test_gradtrack_disabled_0_leaves_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADTRACK_DISABLED", "0")
    model = nn.Linear(3, 1)
    sink = MemorySink()
    with gradtrack.watch(model, backend=sink, log_every=1):
        model(torch.randn(2, 3)).sum().backward()
    assert [record.step for record in sink.records] == [0]


def test_a_value_that_is_not_a_switch_names_the_variable_and_the_allowed_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GRADTRACK_DISABLED", "maybe")
    expected = r"GRADTRACK_DISABLED='maybe'.*1, true"
    with pytest.raises(gradtrack.GradtrackConfigError, match=expected):
        gradtrack.watch(nn.Linear(3, 1), backend="memory")


def _public(names: Iterable[str]) -> set[str]:
    return {name for name in names if not name.startswith("_")}


def test_the_null_watcher_answers_every_public_member_of_the_watcher() -> None:
    protocol = _public(vars(WatcherLike)) | _public(WatcherLike.__annotations__)
    assert _public(dir(Watcher)) <= protocol  # a new public member of Watcher must join it
    model = nn.Linear(3, 1)
    with gradtrack.watch(model, backend="memory") as real:
        assert protocol <= _public(dir(real))
    null = gradtrack.watch(model, backend="memory", enabled=False)
    assert isinstance(null, NullWatcher) and not isinstance(null, Watcher)
    assert protocol <= _public(dir(null))


def test_everything_a_script_calls_on_a_watcher_works_on_the_null_one_and_does_nothing() -> None:
    model = nn.Linear(3, 1)
    before = [dict(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]
    watcher = gradtrack.watch(model, backend=MemorySink(), enabled=False, steps="manual")
    watcher.step = 10  # as the framework callbacks set it
    watcher.end_step()
    watcher.guard_reads_host = False
    assert (watcher.step, watcher.guard_reads_host, watcher.closed) == (11, False, False)
    assert (watcher.layer_names, watcher.sinks, watcher.sink_errors) == ((), [], {})
    assert (watcher.dropped_steps, watcher.host_transfers) == (0, 0)
    assert watcher.flush() and watcher.flush(timeout_s=0.1) and not watcher.config.enabled
    with pytest.raises(KeyboardInterrupt), watcher as entered:
        assert entered is watcher
        raise KeyboardInterrupt
    watcher.close()  # twice is fine
    watcher.end_step()
    assert watcher.closed and watcher.step == 11
    assert [dict(p._post_accumulate_grad_hooks or {}) for p in model.parameters()] == before
    gradtrack.unwatch(model)  # nothing registered
    gradtrack.watch(model, backend="memory").close()
