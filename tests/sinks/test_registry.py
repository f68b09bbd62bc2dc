"""Backends by name, by instance, or several at once; clear errors for anything else."""

from __future__ import annotations

import pytest
from torch import nn

import gradtrack
from gradtrack.sinks import ConsoleSink, MemorySink, registered_sinks


def test_unknown_backend_lists_the_registered_ones() -> None:
    with pytest.raises(gradtrack.GradtrackError) as error:
        gradtrack.watch(nn.Linear(2, 2), backend="consol")
    message = str(error.value)
    assert "unknown backend 'consol'" in message and "Did you mean 'console'?" in message
    assert "console, memory" in message


def test_names_and_instances_mix() -> None:
    sink = MemorySink()
    with gradtrack.watch(nn.Linear(2, 2), backend=["console", sink, "memory"]) as watcher:
        kinds = [type(s) for s in watcher.sinks]
    assert kinds == [ConsoleSink, MemorySink, MemorySink] and watcher.sinks[1] is sink


def test_register_sink_adds_a_backend_name() -> None:
    made: list[MemorySink] = []

    def factory(config: gradtrack.GradtrackConfig) -> MemorySink:
        made.append(MemorySink())
        return made[-1]

    gradtrack.register_sink("test-notebook", factory)
    assert "test-notebook" in registered_sinks()
    model = nn.Linear(2, 1)
    with gradtrack.watch(model, backend="test-notebook", log_every=1):
        model(nn.init.ones_(nn.Parameter(model.weight.new_empty(1, 2)))).sum().backward()
    assert len(made) == 1 and made[0].closed and len(made[0].records) == 1


def test_what_is_not_a_sink_is_refused() -> None:
    with pytest.raises(gradtrack.GradtrackError, match="neither a registered name, a GradientSink"):
        gradtrack.watch(nn.Linear(2, 2), backend=[object()])
    with pytest.raises(gradtrack.GradtrackError, match="backend is empty"):
        gradtrack.watch(nn.Linear(2, 2), backend=[])
    gradtrack.register_sink("test-broken", lambda config: "not a sink")  # type: ignore[arg-type,return-value]
    with pytest.raises(gradtrack.GradtrackError, match="returned 'not a sink', not a sink"):
        gradtrack.watch(nn.Linear(2, 2), backend="test-broken")
