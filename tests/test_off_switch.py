"""The off switch: ``GRADTRACK_DISABLED=1`` / ``enabled=False`` keep the ``watch`` line inert."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.sinks import MemorySink
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
