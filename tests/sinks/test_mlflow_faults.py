"""Nothing lost to the faults a tracking server really has, while training runs at its pace:
a real `mlflow server` frozen (SIGSTOP), killed and restarted, or starting late."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import gradtrack
from tests.sinks.mlflow_server import MlflowServer, lock_sqlite

pytestmark = pytest.mark.solo  # timing promises: run alone (scripts/test.sh)

mlflow = pytest.importorskip("mlflow")

STEPS = 1200
STEP_S = 0.025  # the loop's own pace; gradtrack logs every step


FAULTS = {
    # fault → (what happens at step 300, whether the server runs at the start)
    "frozen 15 s": (lambda server: server.freeze(15.0), True),
    "killed, restarted 5 s later": (lambda server: server.restart(5.0), True),
    "started 10 s late": (lambda server: server.start_after(10.0), False),
}


def train_through_fault(
    uri: str,
    fault_at: int,
    inject: Callable[[], None],
    before: Callable[[gradtrack.Watcher], object] = lambda watcher: None,
) -> gradtrack.Watcher:
    """STEPS steps at STEP_S each, every step logged to MLflow at ``uri``; at step ``fault_at``
    ``before(watcher)`` runs, then the fault starts on a thread of its own. The watcher is
    closed (after the fault)."""
    model = nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    watcher = gradtrack.watch(
        model, backend="mlflow", optimizer=optimizer, log_every=1, histograms=False,
        flush_timeout_s=120, mlflow={"tracking_uri": uri, "retry_max_s": 2},
    )  # fmt: skip
    faulting = threading.Thread(target=inject)
    for step in range(STEPS):
        if step == fault_at:
            before(watcher)
            faulting.start()
        optimizer.zero_grad()
        model(torch.randn(8, 16)).pow(2).mean().backward()
        optimizer.step()
        time.sleep(STEP_S)
    faulting.join()
    watcher.close()
    return watcher


def assert_every_step_stored_once(watcher: gradtrack.Watcher, uri: str) -> None:
    assert watcher.dropped_steps == 0
    run_id = watcher.sinks[0].run_id
    history = mlflow.MlflowClient(uri).get_metric_history(run_id, "grad/total_norm")
    assert sorted(m.step for m in history) == list(range(STEPS))  # every step, each once


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.slow
def test_every_step_stored_once_through_a_server_fault(tmp_path: Path, fault: str) -> None:
    inject, running = FAULTS[fault]
    server = MlflowServer(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path)
    if running:
        server.start()
    try:
        watcher = train_through_fault(server.uri, 300 if running else 0, lambda: inject(server))
        assert_every_step_stored_once(watcher, server.uri)
    finally:
        server.stop()


@pytest.mark.slow
def test_every_step_stored_once_through_a_locked_sqlite_store(tmp_path: Path) -> None:
    """The embedded default store, locked by another process for 15 s mid-run (MLflow's
    store waits on the lock, so the sink's writes block meanwhile: the steps wait)."""
    database = tmp_path / "mlflow.db"
    uri = f"sqlite:///{database}"
    watcher = train_through_fault(
        uri, 300, lambda: lock_sqlite(database, 15.0),
        before=lambda watcher: watcher.flush(timeout_s=120),  # the store exists: lock it
    )  # fmt: skip
    assert_every_step_stored_once(watcher, uri)


@pytest.mark.slow
def test_a_cold_start_loses_nothing_in_a_tight_loop(tmp_path: Path) -> None:
    """A fresh interpreter (mlflow not yet imported) and a fresh embedded store: importing
    MLflow and creating its tables take seconds while the loop runs as fast as it can."""
    code = textwrap.dedent(
        """
        import torch, gradtrack
        model = torch.nn.Linear(16, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        watcher = gradtrack.watch(model, backend="mlflow", optimizer=optimizer, log_every=1,
                                  histograms=False)
        for _ in range(3000):
            optimizer.zero_grad()
            model(torch.randn(8, 16)).pow(2).mean().backward()
            optimizer.step()
        watcher.close()
        print(watcher.dropped_steps, watcher.sinks[0].run_id)
        """
    )
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    dropped, run_id = result.stdout.split()[-2:]
    assert dropped == "0"
    history = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"]).get_metric_history(
        run_id, "grad/total_norm"
    )
    assert sorted(m.step for m in history) == list(range(3000))
