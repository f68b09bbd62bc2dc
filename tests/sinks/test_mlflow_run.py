"""The MLflow run as training left it: several models kept apart, the status of a run that
failed or was interrupted, its files closed, and no password in anything gradtrack says."""

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
from gradtrack.formats.mlflow import read_alerts, read_histograms
from gradtrack.sinks import MlflowSink
from tests.conftest import NoUpdate, SmallCNN
from tests.sinks.test_mlflow import train

mlflow = pytest.importorskip("mlflow")


@pytest.mark.slow
def test_two_models_in_one_run_keep_their_alerts_histograms_and_tags(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    run = client.create_run(client.create_experiment("shared"))
    run_id = run.info.run_id
    models = {}
    for name, nan_at in (("actor", 3), ("critic", None)):
        torch.manual_seed(0)
        model = SmallCNN()
        optimizer = NoUpdate(model.parameters())
        sink = MlflowSink(
            gradtrack.GradtrackConfig(model_name=name, mlflow={"tracking_uri": uri}), run_id=run_id
        )
        with gradtrack.watch(
            model, backend=sink, optimizer=optimizer, histograms={"every": 2}, model_name=name
        ):
            train(model, range(6), optimizer, nan_at=nan_at)
        models[name] = sink
    actor, critic = read_alerts(run_id, uri, "actor"), read_alerts(run_id, uri, "critic")
    assert [e.rule for e in actor] == ["nonfinite"] and actor[0].step == 3
    assert critic == []  # and the actor's NaN alert was not overwritten by it
    assert sorted(read_histograms(run_id, uri, "actor")["0"])[0][0] == 0
    assert [s for s, _ in read_histograms(run_id, uri, "critic")["0"]] == [0, 2, 4]
    tags = client.get_run(run_id).data.tags
    assert tags["gradtrack.actor.first_nonfinite_step"] == "3"
    assert "gradtrack.critic.first_nonfinite_step" not in tags
    assert {"gradtrack.actor.alert.count", "gradtrack.critic.weakest_layer"} <= set(tags)
    artifacts = {f.path for f in client.list_artifacts(run_id, "gradtrack")}
    assert {"gradtrack/actor", "gradtrack/critic"} <= artifacts


@pytest.mark.parametrize(
    ("ending", "status"),
    [
        ("pass", "FINISHED"),
        ("raise ValueError('diverged')", "FAILED"),
        ("raise KeyboardInterrupt", "KILLED"),
    ],
)
@pytest.mark.slow
def test_a_run_gradtrack_started_ends_with_how_training_ended(
    tmp_path: Path, ending: str, status: str
) -> None:
    """A script that never closes its watcher: the exit hook marks the run."""
    code = textwrap.dedent(
        f"""
        import torch, gradtrack
        model = torch.nn.Linear(3, 1)
        watcher = gradtrack.watch(model, backend="mlflow", log_every=1)
        for _ in range(5):
            model(torch.randn(2, 3)).sum().backward()
        print(watcher.sinks[0].run_id if watcher.sinks[0].run_id else "", flush=True)
        watcher.flush()
        print(watcher.sinks[0].run_id, flush=True)
        {ending}
        """
    )
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip
    run_id = result.stdout.split()[-1]
    run = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"]).get_run(run_id)
    assert run.info.status == status, result.stderr[-2000:]


@pytest.mark.slow
def test_an_exception_inside_the_with_block_marks_the_run_failed(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    model = nn.Linear(3, 1)
    with pytest.raises(ValueError, match="diverged"):
        with gradtrack.watch(
            model, backend="mlflow", log_every=1, mlflow={"tracking_uri": uri}
        ) as w:
            model(torch.randn(2, 3)).sum().backward()
            raise ValueError("diverged")
    assert mlflow.MlflowClient(uri).get_run(w.sinks[0].run_id).info.status == "FAILED"


def open_files_under(directory: Path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            found.append(target)
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux only: reads /proc")
@pytest.mark.slow
def test_close_leaves_no_file_of_the_embedded_store_open(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    model = nn.Linear(3, 1)
    with gradtrack.watch(model, backend="mlflow", log_every=1, mlflow={"tracking_uri": uri}):
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
    assert open_files_under(tmp_path) == []


@pytest.mark.slow
def test_nan_at_an_unlogged_step_reaches_mlflow_as_that_step(tmp_path: Path) -> None:
    """The defaults (log_every=10): a NaN at step 13 is stored as step 13, not 20."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    torch.manual_seed(0)
    model = SmallCNN()
    optimizer = NoUpdate(model.parameters())
    with gradtrack.watch(
        model, backend="mlflow", optimizer=optimizer, mlflow={"tracking_uri": uri}
    ) as watcher:
        train(model, range(25), optimizer, nan_at=13)
    client = mlflow.MlflowClient(uri)
    run_id = watcher.sinks[0].run_id
    assert [m.step for m in client.get_metric_history(run_id, "grad_nan/3")] == [13]
    assert sorted(m.step for m in client.get_metric_history(run_id, "grad/total_norm")) == [
        0, 10, 13, 20,
    ]  # fmt: skip
    assert client.get_run(run_id).data.tags["gradtrack.first_nonfinite_step"] == "13"
