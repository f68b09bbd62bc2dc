"""The worker in a child process (`gradtrack.worker.process`): a watch into MLflow assembles,
judges and delivers its steps in a process of its own, against MLflow's real embedded store
and a real `mlflow server`; and the faults a pair of processes meets — the worker process
killed, the training process killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.delivery.sync import sync
from gradtrack.worker.process import WorkerProcess
from gradtrack.worker.thread import Worker
from tests.conftest import Told
from tests.sinks.mlflow_server import MlflowServer

mlflow = pytest.importorskip("mlflow")
REPO = Path(__file__).resolve().parents[1]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, nan_at: int = -1):
    for step in steps:
        optimizer.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        if step == nan_at:
            model[0].weight.grad[0, 0] = float("nan")
        optimizer.step()


def stored_steps(uri: str, run_id: str) -> list[int]:
    history = mlflow.MlflowClient(uri).get_metric_history(run_id, "grad/total_norm")
    return sorted(metric.step for metric in history)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_a_tight_loop_into_mlflow_runs_its_worker_apart_and_stores_every_step(
    tmp_path: Path, spool_in_tmp: Path
) -> None:
    """3,000 steps with no sleep at log_every=1 into the embedded store: the records, rules
    and MLflow's client run in the worker process (no worker or courier thread here), the
    alert of a NaN step is acted on here, and by the end of close() every step is stored
    once, the run FINISHED, the worker process gone and its spool removed."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    alerts: list[tuple[str, int, str]] = []
    watcher = gradtrack.watch(
        model,
        backend="mlflow",
        optimizer=optimizer,
        log_every=1,
        alerts={"nonfinite": {"action": "skip"}},  # (the NaN step leaves the weights as they were)
        mlflow={"tracking_uri": uri},
        on_alert=lambda e: alerts.append((e.rule, e.step, threading.current_thread().name)),
    )
    worker = watcher.worker
    assert isinstance(worker, WorkerProcess) and worker.pid != os.getpid()
    train(model, optimizer, range(3000), nan_at=2000)
    assert alive(worker.pid)
    names = {thread.name for thread in threading.enumerate()}
    assert "gradtrack-worker" not in names and "gradtrack-MlflowSink" not in names
    watcher.close()
    assert not alive(worker.pid)
    run_id = watcher.sinks[0].run_id
    assert stored_steps(uri, run_id) == list(range(3000))  # each once
    assert ("nonfinite", 2000, "gradtrack-listen") in alerts
    assert mlflow.MlflowClient(uri).get_run(run_id).info.status == "FINISHED"
    assert not spool_in_tmp.exists() or not any(spool_in_tmp.iterdir())
    assert watcher.dropped_steps == 0 and watcher.sink_errors == {"0:MlflowSink": 0}


@pytest.mark.slow
def test_past_the_queue_bound_a_worker_process_behind_the_loop_drops_counted_never_silently(
    tmp_path: Path,
) -> None:
    """``delivery.queue_size=20`` at log_every=1: while the worker process starts (MLflow's
    import, the store's creation) a tight loop outruns it by hundreds of steps, the queue in
    this process, the pipe and the child's own queue all fill, and the oldest steps are
    dropped. Every step is stored once or counted as dropped, none lost silently."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    watcher = gradtrack.watch(
        model,
        backend="mlflow",
        optimizer=optimizer,
        log_every=1,
        delivery={"queue_size": 20},
        mlflow={"tracking_uri": uri},
    )
    assert isinstance(watcher.worker, WorkerProcess)
    train(model, optimizer, range(2000))
    watcher.close()
    stored = stored_steps(uri, watcher.sinks[0].run_id)
    assert len(set(stored)) == len(stored) and set(stored) <= set(range(2000))
    assert watcher.dropped_steps > 0
    assert len(stored) + watcher.dropped_steps == 2000
    assert stored[-1] == 1999  # the newest kept


def test_a_raise_rule_is_answered_by_the_worker_process_before_the_update(
    tmp_path: Path,
) -> None:
    """A raise rule's step waits for the worker's judgement; from a worker process the answer
    comes back through the pipe, and the error stops training before the optimizer applies
    the step."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with gradtrack.watch(
        model,
        backend="mlflow",
        optimizer=optimizer,
        alerts={"nonfinite": {"action": "raise"}},
        mlflow={"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    ) as watcher:
        assert isinstance(watcher.worker, WorkerProcess)
        with pytest.raises(gradtrack.GradientAlertError) as raised:
            train(model, optimizer, range(40), nan_at=25)
        assert raised.value.event.step == 25 and raised.value.event.rule == "nonfinite"
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_sinks_that_live_only_here_keep_a_worker_thread(tmp_path: Path) -> None:
    """A memory sink (its records are read in this process) keeps the worker a thread, and so
    does ``delivery.process=False`` with MLflow."""
    model = mlp()
    with gradtrack.watch(model, backend=["memory"]) as watcher:
        assert isinstance(watcher.worker, Worker)
    options = {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    with gradtrack.watch(model, backend="mlflow", mlflow=options, delivery={"process": False}) as w:
        assert isinstance(w.worker, Worker)


@pytest.mark.slow
def test_a_worker_process_that_dies_is_told_once_and_sync_delivers_what_it_held(
    tmp_path: Path, spool_in_tmp: Path, told: Told
) -> None:
    """The server is not up yet, so every step waits in the worker process's spool; the worker
    process is killed. Training goes on, the loss is told once, every later step is counted as
    dropped, close returns at once, and ``gradtrack sync`` then delivers the held steps once."""
    server = MlflowServer(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "server")
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    watcher = gradtrack.watch(
        model,
        backend="mlflow",
        optimizer=optimizer,
        flush_timeout_s=3,
        mlflow={"tracking_uri": server.uri, "retry_max_s": 1, "request_timeout_s": 2},
    )
    worker = watcher.worker
    assert isinstance(worker, WorkerProcess)
    train(model, optimizer, range(200))
    assert not watcher.flush(timeout_s=2)  # held: the server is away
    os.kill(worker.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while told.count("worker process stopped") == 0 and time.monotonic() < deadline:
        train(model, optimizer, range(10))
    train(model, optimizer, range(100))
    started = time.monotonic()
    watcher.close()
    assert time.monotonic() - started < 5
    assert told.count("gradtrack's worker process stopped (exit code -9)") == 1
    (held,) = list(spool_in_tmp.iterdir())
    assert any(f"gradtrack sync {held}" in m for m in told.messages)
    logged_after = (watcher.step - 200 + 9) // 10
    assert watcher.dropped_steps == logged_after
    server.start()
    try:
        result = sync(held)
        assert result.left == 0 and not held.exists()
        run_id = result.runs["0-MlflowSink"].split()[2]
        assert stored_steps(server.uri, run_id) == list(range(0, 200, 10))
    finally:
        server.stop()


@pytest.mark.slow
def test_a_training_process_killed_outright_leaves_its_worker_to_deliver_every_step(
    tmp_path: Path, spool_in_tmp: Path
) -> None:
    """SIGKILL (no close, no exit hook) once every step went to the worker process: the worker
    process delivers all 1,500 steps, ends the run KILLED, removes its spool and exits."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = textwrap.dedent(
        f"""
        import os, signal, time, torch, gradtrack
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        watcher = gradtrack.watch(model, backend="mlflow", optimizer=optimizer, log_every=1,
                                  mlflow={{"tracking_uri": {uri!r}}})
        for _ in range(1500):
            optimizer.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            optimizer.step()
        while len(watcher.mailbox):  # every step handed to the worker process
            time.sleep(0.01)
        time.sleep(0.5)
        print(watcher.worker.pid, watcher.sinks[0].run_id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    env = {**os.environ, "GRADTRACK_SPOOL_DIR": str(spool_in_tmp), "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    pid, run_id = result.stdout.split()
    deadline = time.monotonic() + 180
    while alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(int(pid))
    assert stored_steps(uri, run_id) == list(range(1500))  # each once
    assert mlflow.MlflowClient(uri).get_run(run_id).info.status == "KILLED"
    assert not any(spool_in_tmp.iterdir())


def test_the_worker_process_imports_gradtrack_from_where_this_process_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child gets this process's sys.path, whatever its working directory and
    PYTHONPATH: a run started from another folder still has its steps delivered."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with gradtrack.watch(model, backend="mlflow", optimizer=optimizer) as watcher:
        assert isinstance(watcher.worker, WorkerProcess)
        train(model, optimizer, range(20))
        assert watcher.flush(timeout_s=60)  # delivered by its end, the run still open
        assert stored_steps("sqlite:///mlflow.db", watcher.sinks[0].run_id) == [0, 10]


def test_host_copies_cross_the_pipe_exact_whatever_their_dtype_or_layout() -> None:
    """Tensors go to the worker process as numpy arrays (torch's own pickling is ~6x slower);
    a view carries only its elements, and a dtype numpy lacks (bfloat16) goes torch's way."""
    import pickle

    from gradtrack.worker.process import _dumps

    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    tensors = {
        "rows": base,
        "view": base[1:3, ::2],
        "samples": torch.randn(1000, dtype=torch.float32),
        "counts": torch.tensor([1, 2, 3]),
        "bf16": torch.randn(8).to(torch.bfloat16),
    }
    message = _dumps(("steps", tensors))
    _, back = pickle.loads(message)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert len(_dumps(tensors["view"])) < len(_dumps(base))  # not the whole storage
