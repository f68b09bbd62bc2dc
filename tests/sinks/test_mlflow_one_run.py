"""One run: with no active MLflow run, gradtrack's run is the one the user's own
``mlflow.log_metric`` calls land in, and the terminal says which run it is."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import gradtrack
from tests.conftest import SmallCNN, Told, cnn_batch
from tests.sinks.mlflow_server import MlflowServer

mlflow = pytest.importorskip("mlflow")


def run_script(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter in ``cwd``: MLflow's embedded default store there, no
    logging set up, as a user's script runs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "GRADTRACK_"))}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def all_run_ids(client: mlflow.MlflowClient) -> set[str]:
    experiments = [e.experiment_id for e in client.search_experiments()]
    return {run.info.run_id for run in client.search_runs(experiments)}


@pytest.mark.slow
def test_users_log_metric_lands_in_gradtracks_run(
    mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    client = mlflow.MlflowClient(mlflow_server.uri)
    before = all_run_ids(client)
    assert mlflow.active_run() is None
    torch.manual_seed(0)
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    watcher = gradtrack.watch(model, backend="mlflow", optimizer=optimizer)  # log_every=10
    for step in range(20):
        images, labels = cnn_batch(batch_size=4, seed=step)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        mlflow.log_metric("loss", loss.item(), step=step)
    watcher.close()

    run_id = watcher.sinks[0].run_id
    assert all_run_ids(client) - before == {run_id}  # one run, not the user's and gradtrack's
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == list(range(20))
    assert [m.step for m in client.get_metric_history(run_id, "grad/total_norm")] == [0, 10]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert mlflow.active_run() is None  # ended in the user's thread too
    with mlflow.start_run() as next_run:  # the user's next run is a run of its own
        assert next_run.info.run_id != run_id
    mlflow.set_tracking_uri(None)


@pytest.mark.slow
def test_a_run_left_undelivered_is_let_go_so_the_next_run_is_new(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, told: Told
) -> None:
    server = MlflowServer(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path).start()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    try:
        model = nn.Linear(3, 1)
        watcher = gradtrack.watch(
            model, backend="mlflow", log_every=1, flush_timeout_s=2.0,
            mlflow={"request_timeout_s": 1.0, "retry_max_s": 1.0},
        )  # fmt: skip
        first = watcher.sinks[0].run_id
        assert mlflow.active_run().info.run_id == first
        server.stop()  # the close cannot deliver, nor end the run
        model(torch.randn(2, 3)).sum().backward()
        watcher.close()
        assert told.count("cannot reach MLflow") == 1 and told.count("made no progress") == 1
        assert mlflow.active_run() is None  # no later run writes into the stale one
    finally:
        server.stop()


@pytest.mark.slow
def test_a_script_without_logging_setup_shows_the_run_and_the_report_command(
    tmp_path: Path,
) -> None:
    code = textwrap.dedent(
        """
        import mlflow, torch, gradtrack
        model = torch.nn.Linear(3, 1)
        watcher = gradtrack.watch(model, backend="mlflow")
        for step in range(12):
            loss = model(torch.randn(2, 3)).pow(2).mean()
            loss.backward()
            mlflow.log_metric("loss", loss.item(), step=step)
        watcher.close()
        print(watcher.sinks[0].run_id)
        """
    )
    done = run_script(code, tmp_path)
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.split()[-1]
    lines = [line for line in done.stderr.splitlines() if line.startswith("[gradtrack]")]
    assert lines[0].startswith("[gradtrack] MLflow run " + run_id)
    assert "your own mlflow.log_* calls land in it too" in lines[0]
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlflow.db" in lines[0]
    assert lines[1].startswith("[gradtrack] watching 1 layers of Linear, every 10 steps")
    assert lines[-1] == (
        f"[gradtrack] closed after 12 steps; its report: gradtrack report {run_id} "
        f"--tracking-uri sqlite:///{tmp_path}/mlflow.db"
    )
    store = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert all_run_ids(store) == {run_id}


@pytest.mark.slow
def test_a_failed_script_whose_close_runs_out_of_time_is_not_marked_finished(
    tmp_path: Path,
) -> None:
    """MLflow's own exit hook ends the active run FINISHED; gradtrack's runs before it."""
    code = textwrap.dedent(
        """
        import torch, gradtrack
        model = torch.nn.Linear(3, 1)
        watcher = gradtrack.watch(model, backend="mlflow", log_every=1, flush_timeout_s=0.01)
        print(watcher.sinks[0].run_id, flush=True)
        for _ in range(5):
            model(torch.randn(2, 3)).sum().backward()
        raise ValueError("diverged")
        """
    )
    done = run_script(code, tmp_path)
    assert "ValueError: diverged" in done.stderr
    run_id = done.stdout.split()[0]
    run = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(run_id)
    assert run.info.status in ("RUNNING", "FAILED"), done.stderr  # never FINISHED
