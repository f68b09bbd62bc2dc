"""The MLflow sink against real `mlflow server` processes and the embedded SQLite default."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.formats.mlflow import DROPPED_KEY, read_alerts, read_histograms
from gradtrack.sinks import MemorySink, MlflowSink
from tests.conftest import NoUpdate, SmallCNN, Told, cnn_batch, watch_without
from tests.sinks.mlflow_server import MlflowServer, free_port

mlflow = pytest.importorskip("mlflow")


def train(
    model: nn.Module, watcher_steps: range, optimizer: Any, nan_at: int | None = None
) -> None:
    for step in watcher_steps:
        images, labels = cnn_batch(batch_size=4, seed=step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(images), labels).backward()
        if step == nan_at:
            model[3].weight.grad[0, 0, 0, 0] = float("nan")
        optimizer.step()


def histories(uri: str, run_id: str, keys: list[str]) -> dict[str, list[tuple[int, float]]]:
    client = mlflow.MlflowClient(uri)
    return {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        for key in keys
    }


def assert_same_series(got: list[tuple[int, float]], expected: list[tuple[int, float]]) -> None:
    assert [s for s, _ in got] == [s for s, _ in expected]
    for (_, a), (_, b) in zip(got, expected):
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12)


@pytest.mark.slow
def test_round_trip_through_a_tracking_server(mlflow_server: MlflowServer) -> None:
    torch.manual_seed(0)
    model = SmallCNN()
    optimizer = NoUpdate(model.parameters())
    memory = MemorySink()
    options = {"tracking_uri": mlflow_server.uri, "experiment": "round-trip", "run_name": "cnn"}
    with gradtrack.watch(
        model, backend=["mlflow", memory], optimizer=optimizer, log_every=2,
        histograms={"every": 6, "sample_size": 500}, mlflow={**options, "hist_chunk_steps": 2},
    ) as watcher:  # fmt: skip
        train(model, range(24), optimizer, nan_at=10)
    sink = watcher.sinks[0]
    assert isinstance(sink, MlflowSink) and watcher.sink_errors["0:MlflowSink"] == 0

    client = mlflow.MlflowClient(mlflow_server.uri)
    run = client.get_run(sink.run_id)
    assert (run.info.status, run.info.run_name) == ("FINISHED", "cnn")
    expected = memory.scalars(windows=True)  # the NaN's flight window: steps 0-10 per layer
    assert set(run.data.metrics) == set(expected)
    for key, series in histories(mlflow_server.uri, sink.run_id, list(expected)).items():
        assert_same_series(series, expected[key])

    stored = read_histograms(sink.run_id, mlflow_server.uri)
    for layer, series in memory.histograms().items():
        assert [step for step, _ in stored[layer]] == [step for step, _ in series] == [0, 6, 12, 18]
        for (_, got), (_, want) in zip(stored[layer], series):
            np.testing.assert_array_equal(got.counts, want.counts)
            np.testing.assert_array_equal(got.edges, want.edges)
    files = [f.path for f in client.list_artifacts(sink.run_id, "gradtrack/histograms")]
    assert len(files) == 2  # two steps per file: 0+6, 12+18

    tags = run.data.tags
    assert tags["gradtrack.first_nonfinite_step"] == "10"
    assert tags["gradtrack.first_nonfinite_layer"] == "3"
    assert int(tags["gradtrack.alert.count"]) == len(memory.events) >= 1
    last = memory.events[-1]
    assert tags["gradtrack.alert.last"] == f"step {last.step}: {last.message}"
    assert any(e.rule == "nonfinite" and e.step == 10 for e in memory.events)
    alerts = read_alerts(sink.run_id, mlflow_server.uri)
    assert [e.model_dump() for e in alerts] == [e.model_dump() for e in memory.events]
    assert tags["gradtrack.weakest_layer"] in {"0", "3", "7"}


def test_an_active_run_is_reused_and_left_open(mlflow_server: MlflowServer) -> None:
    mlflow.set_tracking_uri(mlflow_server.uri)
    try:
        with mlflow.start_run(run_name="users-own") as run:
            model = nn.Linear(3, 1)
            with gradtrack.watch(model, backend="mlflow", log_every=1) as watcher:
                model(torch.randn(2, 3)).sum().backward()
            assert watcher.sinks[0].run_id == run.info.run_id
            assert mlflow.MlflowClient().get_run(run.info.run_id).info.status == "RUNNING"
        history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "grad/total_norm")
        assert [m.step for m in history] == [0]
    finally:
        mlflow.set_tracking_uri(None)


@pytest.mark.slow
def test_embedded_default_is_mlflow_db_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    model = nn.Linear(3, 1)
    with gradtrack.watch(model, backend="mlflow", log_every=1, mlflow={"run_name": "local"}) as w:
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
    assert (tmp_path / "mlflow.db").exists()
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(w.sinks[0].run_id)
    assert run.info.run_name == "local" and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "grad/total_norm")] == [
        0,
        1,
        2,
    ]


@pytest.mark.slow
def test_per_layer_series_every_layer_every_steps_and_nonfinite_steps_in_full(
    tmp_path: Path,
) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    torch.manual_seed(0)
    model = SmallCNN()
    optimizer = NoUpdate(model.parameters())
    with gradtrack.watch(
        model, backend="mlflow", optimizer=optimizer, log_every=2, layer_every=5,
        histograms=False, mlflow={"tracking_uri": uri},
        flight={"enabled": False},  # the schedule alone (the NaN's window: tests/flight)
    ) as watcher:  # fmt: skip
        train(model, range(12), optimizer, nan_at=8)
    got = histories(uri, watcher.sinks[0].run_id, ["grad/total_norm", "grad_norm/0", "grad_max/7"])
    assert [s for s, _ in got["grad/total_norm"]] == [0, 2, 4, 6, 8, 10]
    # First logged step of each 5-step window (0, 6, 10), and step 8, whose gradient was NaN.
    assert [s for s, _ in got["grad_norm/0"]] == [0, 6, 8, 10]
    # Max and mean |g| are computed on those steps only (two more passes over memory); the
    # guard saw step 8 was non-finite before summarising it, so it has them too.
    assert [s for s, _ in got["grad_max/7"]] == [0, 6, 8, 10]


@pytest.mark.slow
def test_steps_go_out_every_send_every_s_alerts_within_a_second_and_at_flush(
    tmp_path: Path,
) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    model = nn.Linear(4, 1)
    watcher = gradtrack.watch(
        model, backend="mlflow", log_every=1, histograms=False,
        delivery={"batch_wait_s": 0.0}, mlflow={"tracking_uri": uri, "send_every_s": 3600},
    )  # fmt: skip
    sink = watcher.sinks[0]

    def logged() -> list[int]:
        if sink.run_id is None:
            return []
        return [s for s, _ in histories(uri, sink.run_id, ["grad/total_norm"])["grad/total_norm"]]

    def step(scale: float = 1.0) -> None:
        (model(torch.randn(2, 4)).sum() * scale).backward()
        model.zero_grad()

    def wait_for(steps: list[int], within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while logged() != steps and time.monotonic() < deadline:
            time.sleep(0.05)
        assert logged() == steps

    step()
    wait_for([0], 60)  # the first step goes at once (the run appears), after MLflow's start
    step()
    step()
    time.sleep(1.5)
    assert logged() == [0]  # the others wait for send_every_s, or a full batch
    step(float("nan"))  # an alert goes within a second, with everything waiting
    wait_for([0, 1, 2, 3], 5)
    step()
    time.sleep(1.5)
    assert logged() == [0, 1, 2, 3]
    watcher.flush()
    assert logged() == [0, 1, 2, 3, 4]
    watcher.close()
    assert [a.step for a in read_alerts(sink.run_id, uri)] == [3]


def outage_config(uri: str, **more: Any) -> dict[str, Any]:
    return {"tracking_uri": uri, "retry_max_s": 1.0, "request_timeout_s": 2.0, **more}


@pytest.mark.slow
def test_server_down_at_start_then_killed_and_restarted_loses_nothing(
    tmp_path: Path, told: Told
) -> None:
    server = MlflowServer(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path)  # not started yet
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    memory = MemorySink()
    watcher = gradtrack.watch(
        model, backend=["mlflow", memory], log_every=1, histograms={"every": 5},
        delivery={"batch_wait_s": 0.05}, mlflow=outage_config(server.uri),
    )  # fmt: skip

    def steps(n: int) -> None:
        for _ in range(n):
            model(torch.randn(4, 4)).pow(2).sum().backward()
            model.zero_grad()

    try:
        # While the server is away a flush cannot finish: it waits until delivery has made
        # no progress for timeout_s (the courier warns at its first failed try).
        steps(10)  # unreachable at start
        assert not watcher.flush(timeout_s=4)
        assert told.count("cannot reach MLflow") == 1  # told once, however many retries
        server.start()
        steps(10)
        watcher.flush()
        server.stop()  # dropped mid-run
        steps(10)
        assert not watcher.flush(timeout_s=4)
        assert told.count("cannot reach MLflow") == 2  # the second outage, told once
        server.start()  # back, on the same store
        steps(10)
        watcher.close()
        sink = watcher.sinks[0]
        assert watcher.worker.delivery_failures[0] >= 2 and watcher.dropped_steps == 0
        expected = memory.scalars()
        got = histories(server.uri, sink.run_id, list(expected))
        for key, series in expected.items():
            assert_same_series(got[key], series)  # every step once, in order, no duplicates
        assert len(got["grad/total_norm"]) == 40
        stored = read_histograms(sink.run_id, server.uri)
        assert [s for s, _ in stored["0"]] == [0, 5, 10, 15, 20, 25, 30, 35]
    finally:
        server.stop()


@pytest.mark.slow
def test_the_spool_is_the_only_backlog_an_outage_drops_nothing(tmp_path: Path, told: Told) -> None:
    """The sink has no buffer of its own: every step of an outage waits in the spool and
    reaches MLflow once it is back."""
    server = MlflowServer(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path)
    model = nn.Linear(4, 1)
    watcher = gradtrack.watch(
        model, backend="mlflow", log_every=1, histograms=False,
        delivery={"batch_wait_s": 0.0}, mlflow=outage_config(server.uri),
    )  # fmt: skip
    try:
        for _ in range(10):
            model(torch.randn(2, 4)).sum().backward()
        assert not watcher.flush(timeout_s=2)  # the server is away: no progress
        assert told.count("cannot reach MLflow") == 1
        server.start()
        model(torch.randn(2, 4)).sum().backward()
        watcher.close()
        sink = watcher.sinks[0]
        client = mlflow.MlflowClient(server.uri)
        kept = [m.step for m in client.get_metric_history(sink.run_id, "grad/total_norm")]
        assert kept == list(range(11)) and watcher.dropped_steps == 0
        assert client.get_metric_history(sink.run_id, DROPPED_KEY) == []
    finally:
        server.stop()


@pytest.mark.slow
def test_close_waits_at_most_the_flush_timeout_for_an_unreachable_server(told: Told) -> None:
    model = nn.Linear(4, 1)
    uri = f"http://127.0.0.1:{free_port()}"
    watcher = gradtrack.watch(
        model, backend="mlflow", log_every=1, histograms=False, flush_timeout_s=2.0,
        mlflow=outage_config(uri),
    )  # fmt: skip
    for _ in range(5):
        model(torch.randn(2, 4)).sum().backward()  # training never waits on the server
    # The worker process's start (its imports, MLflow's) counts as progress, as a cold SDK
    # import always did; the bound runs from the first failed send.
    deadline = time.monotonic() + 60
    while told.count("cannot reach MLflow") == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    start = time.monotonic()
    watcher.close()
    waited_s = time.monotonic() - start
    messages = told.messages
    assert any("cannot reach MLflow" in m for m in messages)
    assert any("made no progress for flush_timeout_s=2 s" in m for m in messages)
    assert any("5 item(s)" in m and "gradtrack sync" in m for m in messages)
    assert watcher.sinks[0].run_id is None
    assert waited_s < 2.0 + 5.0  # the bound is flush_timeout_s; the rest is slack for a busy box


@pytest.mark.slow
def test_keys_mlflow_refuses_are_mapped_not_lost(mlflow_server: MlflowServer) -> None:
    model = nn.ModuleDict({"enc@0": nn.Linear(2, 2), "head[1]": nn.Linear(2, 1)})
    with gradtrack.watch(
        model, backend="mlflow", log_every=1, mlflow={"tracking_uri": mlflow_server.uri}
    ) as watcher:
        model["head[1]"](model["enc@0"](torch.randn(3, 2))).sum().backward()
    run = mlflow.MlflowClient(mlflow_server.uri).get_run(watcher.sinks[0].run_id)
    assert {"grad_norm/enc_0", "grad_norm/head_1_"} <= set(run.data.metrics)


@pytest.mark.slow
def test_missing_mlflow_names_the_extra_to_install() -> None:
    assert "pip install gradtrack[mlflow]" in watch_without("mlflow")


@pytest.fixture(scope="module")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    uri = os.environ.get("POSTGRES_TEST_URI")
    if not uri:
        if os.environ.get("CI"):
            pytest.fail("CI must provide POSTGRES_TEST_URI (.ci/run starts PostgreSQL)")
        pytest.skip("no PostgreSQL here: set POSTGRES_TEST_URI (as .ci/run does)")
    root = tmp_path_factory.mktemp("mlflow-postgres")
    server = MlflowServer(uri, root).start()
    yield server
    server.stop()


@pytest.mark.slow
def test_round_trip_with_a_postgresql_backend_store(postgres_server: MlflowServer) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    memory = MemorySink()
    with gradtrack.watch(
        model, backend=["mlflow", memory], log_every=1, histograms={"every": 2},
        mlflow={"tracking_uri": postgres_server.uri, "experiment": "postgres"},
    ) as watcher:  # fmt: skip
        for _ in range(6):
            model(torch.randn(4, 4)).sum().backward()
            model.zero_grad()
    run_id = watcher.sinks[0].run_id
    expected = memory.scalars()
    for key, series in histories(postgres_server.uri, run_id, list(expected)).items():
        assert_same_series(series, expected[key])
    assert [s for s, _ in read_histograms(run_id, postgres_server.uri)["0"]] == [0, 2, 4]
