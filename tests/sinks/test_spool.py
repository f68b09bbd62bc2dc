"""The durable spool: what a tracker has not confirmed survives a dead process, a frozen
server and a close that times out, and `gradtrack sync` delivers it later, each step once."""

from __future__ import annotations

import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.alerts import AlertEvent
from gradtrack.formats.mlflow import read_alerts
from gradtrack.record import StepRecord
from gradtrack.spool import Spool, SpoolError
from tests.sinks.mlflow_server import MlflowServer, free_port

mlflow = pytest.importorskip("mlflow")

REPO = Path(__file__).resolve().parents[2]


def record(step: int) -> StepRecord:
    return StepRecord(
        step=step, wall_time=1.0 + step, layers=("a", "b"), stats=np.ones((2, 7)), total_norm=1.0
    )


def event(step: int) -> AlertEvent:
    return AlertEvent(
        step=step, wall_time=1.0, rule="nonfinite", layer="a", statistic="nan", value=1.0,
        threshold=None, severity="error", message="NaN",
    )  # fmt: skip


def test_items_come_back_in_order_across_segments_and_reopening(tmp_path: Path) -> None:
    spool = Spool.create(tmp_path, "unit", {"sink": {"backend": "test"}}, 1 << 30)
    spool.segment_bytes = 2_000
    for step in range(60):
        spool.append(event(step) if step % 7 == 3 else record(step))
    reader = spool.reader(0)
    first = list(reader.items(limit=10))
    rest = list(reader.items())
    seqs = [item.seq for item in first + rest]
    assert seqs == list(range(1, 61))
    assert isinstance(first[3].payload, AlertEvent) and first[3].payload.step == 3
    assert rest[-1].payload.step == 59 and len(list(tmp_path.glob("*/seg-*.log"))) > 3
    spool.confirm("sink", 40)  # segments wholly before the cursor go
    assert spool.undelivered() == 20
    spool.close()
    again = Spool(spool.path, 1 << 30)
    assert again.cursor("sink") == 40 and again.last_seq == 60
    assert [i.seq for i in again.reader(40).items()] == list(range(41, 61))
    assert again.append(record(60)) == 61  # numbering goes on after a reopening
    again.close()


def test_a_torn_last_frame_ends_the_log_and_a_foreign_pickle_is_refused(tmp_path: Path) -> None:
    spool = Spool.create(tmp_path, "unit", {"sink": {}}, 1 << 30)
    for step in range(3):
        spool.append(record(step))
    spool.close()
    segment = next(spool.path.glob("seg-*.log"))
    data = segment.read_bytes()
    segment.write_bytes(data[:-5])  # the process died in the middle of the last append
    reopened = Spool(spool.path, 1 << 30)
    assert [i.seq for i in reopened.reader(0).items()] == [1, 2]

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("this must never run",))

    reopened.append(Payload())
    with pytest.raises(pickle.UnpicklingError, match=r"cannot hold builtins\.print"):
        list(reopened.reader(2).items())
    reopened.close()


def test_a_spool_in_use_cannot_be_opened_twice(tmp_path: Path) -> None:
    spool = Spool.create(tmp_path, "unit", {"sink": {}}, 1 << 30)
    with pytest.raises(SpoolError, match="in use by another process"):
        Spool(spool.path, 1 << 30)
    spool.close()
    Spool(spool.path, 1 << 30).close()


def test_past_its_disk_bound_the_spool_drops_counts_and_warns(
    tmp_path: Path, spool_in_tmp: Path
) -> None:
    """No server at all: everything waits in the spool until its 1 MiB bound."""
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(40)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    uri = f"http://127.0.0.1:{free_port()}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watcher = gradtrack.watch(
            model, backend="mlflow", optimizer=optimizer, log_every=1, spool={"mib": 1},
            flush_timeout_s=1, mlflow={"tracking_uri": uri, "retry_max_s": 1},
        )  # fmt: skip
        for _ in range(400):
            optimizer.zero_grad()
            model(torch.randn(4, 64)).sum().backward()
            optimizer.step()
        watcher.close()
    assert watcher.dropped_steps > 0
    assert sum("spool.mib" in str(w.message) for w in caught) == 1  # warned once
    (kept,) = list(spool_in_tmp.iterdir())
    size = sum(f.stat().st_size for f in kept.glob("seg-*.log"))
    assert size <= 1 << 20
    assert any(f"gradtrack sync {kept}" in str(w.message) for w in caught)


Env = dict[str, str] | None


def run_child(
    uri: str, steps: int, end: str, spool_root: Path, *extra: str, env: Env = None
) -> str:
    """Run `tests.sinks.spool_child` (``env`` adds to its bare environment); its stdout and
    stderr."""
    child_env = {"GRADTRACK_SPOOL_DIR": str(spool_root), "PYTHONPATH": str(REPO), "PATH": ""}
    result = subprocess.run(
        [sys.executable, "-m", "tests.sinks.spool_child", uri, str(steps), end, *extra],
        env={**child_env, **(env or {})}, cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert "trained" in result.stdout, result.stderr[-3000:]
    return result.stdout + result.stderr


def sync_cli(spool_root: Path, *args: str, env: Env = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradtrack.cli", "sync", str(spool_root), *args],
        env={"PYTHONPATH": str(REPO), "PATH": "", **(env or {})}, cwd=REPO, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip


def stored_steps(uri: str, run_id: str | None = None) -> list[int]:
    client = mlflow.MlflowClient(uri)
    if run_id is None:
        (run,) = client.search_runs([client.get_experiment_by_name("gradtrack").experiment_id])
        run_id = run.info.run_id
    return sorted(m.step for m in client.get_metric_history(run_id, "grad/total_norm"))


def test_a_killed_process_leaves_its_steps_and_sync_delivers_them_once(
    tmp_path: Path, spool_in_tmp: Path
) -> None:
    """The server is down for the whole run, and the process dies by SIGKILL (no close, no
    exit hook): 300 steps at the defaults are 30 logged steps, all in the spool."""
    server = MlflowServer(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path)
    run_child(server.uri, 300, "kill", spool_in_tmp)
    (left,) = list(spool_in_tmp.iterdir())
    server.start()
    try:
        synced = sync_cli(spool_in_tmp)
        assert synced.returncode == 0, synced.stdout + synced.stderr
        assert "30 item(s) delivered" in synced.stdout
        assert stored_steps(server.uri) == list(range(0, 300, 10))  # each once
        assert not left.exists()  # delivered: nothing left behind
        again = sync_cli(spool_in_tmp)
        assert again.returncode == 0 and "nothing to sync" in again.stderr
    finally:
        server.stop()


def test_resent_items_after_a_crash_are_stored_once(tmp_path: Path, spool_in_tmp: Path) -> None:
    """A tracker may have taken items whose confirmation never reached the disk (the process
    died in between): sync sends them again, and the run still holds each step and alert once."""
    server = MlflowServer(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path).start()
    try:
        run_child(server.uri, 300, "kill", spool_in_tmp, "155")
        (left,) = list(spool_in_tmp.iterdir())
        logged = sorted([*range(0, 300, 10), 155])  # the NaN step is summarised at its step
        assert stored_steps(server.uri) == logged  # delivered before the kill
        client = mlflow.MlflowClient(server.uri)
        (run,) = client.search_runs([client.get_experiment_by_name("gradtrack").experiment_id])
        alerts = [(a.rule, a.step) for a in read_alerts(run.info.run_id, server.uri)]
        assert ("nonfinite", 155) in alerts
        for cursor in left.glob("*.cursor"):
            cursor.write_text("0")  # as if no confirmation had been saved
        synced = sync_cli(spool_in_tmp)
        assert synced.returncode == 0, synced.stdout + synced.stderr
        assert stored_steps(server.uri) == logged  # still each once
        assert [(a.rule, a.step) for a in read_alerts(run.info.run_id, server.uri)] == alerts
        assert client.get_run(run.info.run_id).info.status == "KILLED"  # it died without a word
    finally:
        server.stop()


def test_a_close_that_times_out_names_the_sync_command_which_delivers_the_rest(
    tmp_path: Path, spool_in_tmp: Path
) -> None:
    """The server freezes (SIGSTOP) halfway through a run and is still frozen when the script
    closes (flush_timeout_s=3) and exits: the steps it missed stay in the spool, the warning
    names the command, and once the server is back sync puts them into the same run."""
    server = MlflowServer(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path).start()
    assert server.process is not None
    try:
        output = run_child(server.uri, 400, "close", spool_in_tmp, "-1", str(server.process.pid))
        (left,) = list(spool_in_tmp.iterdir())
        assert f"gradtrack sync {left}" in output
        run_id = output.split("run ")[1].split()[0]
        server.resume()
        assert stored_steps(server.uri, run_id) == list(range(0, 200, 10))
        synced = sync_cli(left)
        assert synced.returncode == 0, synced.stdout + synced.stderr
        assert stored_steps(server.uri, run_id) == list(range(0, 400, 10))  # each once
        run = mlflow.MlflowClient(server.uri).get_run(run_id)
        assert run.info.status == "FINISHED"  # ended once everything was in, as it ended
        assert not left.exists()
    finally:
        server.resume()
        server.stop()


def test_without_the_spool_steps_wait_in_memory_and_no_folder_is_made(
    tmp_path: Path, spool_in_tmp: Path
) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with gradtrack.watch(
        model, backend="mlflow", optimizer=optimizer, spool=False, mlflow={"tracking_uri": uri}
    ) as watcher:
        for _ in range(30):
            optimizer.zero_grad()
            model(torch.randn(8, 8)).pow(2).mean().backward()
            optimizer.step()
    assert not spool_in_tmp.exists()
    assert stored_steps(uri, watcher.sinks[0].run_id) == [0, 10, 20]


def test_sync_of_something_that_is_no_spool_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a spool")
    result = sync_cli(tmp_path / "a-file")
    assert result.returncode == 2
    assert "neither a gradtrack spool nor a folder of spools" in result.stderr
    empty = sync_cli(tmp_path)
    assert empty.returncode == 0 and "nothing to sync" in empty.stderr
