"""The durable spool: what a tracker has not confirmed survives a dead process, a frozen
server and a close that times out, and `gradtrack sync` delivers it later, each step once."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import textwrap
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.delivery.spool import Spool, SpoolError
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.mlflow import read_alerts
from gradtrack.formats.record import StepRecord
from tests.conftest import Told
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


def test_what_waits_is_counted_without_a_scan_of_the_backlog(tmp_path: Path) -> None:
    """A courier and the close progress line ask at every look what waits: counted from the
    gap-free numbering and the alerts' and histogram records' own indexes — the same counts
    as a scan, after items were confirmed, across a reopening, for any range."""
    spool = Spool.create(tmp_path, "unit", {"sink": {"backend": "test"}}, 1 << 30)
    spool.add_cursor("sink")
    kinds = ["alert" if s % 7 == 3 else "hist" if s % 5 == 0 else "plain" for s in range(300)]
    spool.append(
        event(s) if kind == "alert" else histogram_record(s) if kind == "hist" else record(s)
        for s, kind in enumerate(kinds)
    )

    def scanned(after: int, through: int) -> tuple[int, int, int]:
        kept = [k for seq, k in enumerate(kinds, 1) if max(after, done) < seq <= through]
        return len(kept), kept.count("alert"), kept.count("hist")

    for done in (0, 120):
        spool.confirm("sink", done)
        if done:
            spool.close()
            spool = Spool(spool.path, 1 << 30)
        for after, through in [(0, 300), (50, 60), (119, 121), (200, 300), (300, 300)]:
            count, alerts, histograms = scanned(after, through)
            assert spool.waiting(after, through) == (count, alerts)
            assert spool.waiting(after, through, histograms_only=True) == (histograms, 0)
    plans = [
        spool._db.execute(f"EXPLAIN QUERY PLAN SELECT COUNT(*) FROM items WHERE {where}").fetchall()
        for where in ("kind = 'alert' AND seq > 1 AND seq <= 9", "has_histograms = 1 AND seq > 1")
    ]
    assert all("USING INDEX" in str(plan) for plan in plans), plans
    spool.close()


def histogram_record(step: int) -> StepRecord:
    from gradtrack.formats.histogram import bin_samples

    return StepRecord(
        step=step, wall_time=1.0, layers=("a",), stats=np.ones((1, 7)), total_norm=1.0,
        histograms={"a": bin_samples(np.linspace(-1, 1, 50), 8, "log")},
    )  # fmt: skip


def test_items_come_back_in_order_across_reopening_and_confirmed_ones_go(tmp_path: Path) -> None:
    spool = Spool.create(tmp_path, "unit", {"sink": {"backend": "test"}}, 1 << 30)
    spool.add_cursor("sink")
    spool.append(event(step) if step % 7 == 3 else record(step) for step in range(60))
    first = spool.read(0, limit=10)
    rest = spool.read(first[-1].seq, limit=1000)
    assert [item.seq for item in first + rest] == list(range(1, 61))
    assert isinstance(first[3].payload, AlertEvent) and first[3].payload.step == 3
    assert isinstance(rest[-2].payload, StepRecord) and rest[-2].payload.step == 58
    np.testing.assert_array_equal(rest[-2].payload.stats, record(58).stats)
    assert spool.waiting(0, 60) == (60, 9)  # 9 alerts among them
    spool.confirm("sink", 40)  # items every cursor passed go
    assert spool.undelivered() == 20 and spool.waiting(0, 60) == (20, 3)
    spool.close()
    again = Spool(spool.path, 1 << 30)
    assert again.cursor("sink") == 40 and again.last_seq == 60
    assert [i.seq for i in again.read(40, 100)] == list(range(41, 61))
    assert again.append([record(60)]) == [61]  # numbering goes on after a reopening
    again.confirm("sink", 61)
    again.close()
    emptied = Spool(spool.path, 1 << 30)  # every item delivered: numbering still goes on
    assert emptied.last_seq == 61 and emptied.append([record(61)]) == [62]
    emptied.close()


def test_records_keep_every_field_through_the_spool(tmp_path: Path) -> None:
    """NaN and Inf, histograms, spike arrays, tuples and the optional evidence come back
    exactly as written."""
    from gradtrack.formats.histogram import bin_samples

    original = StepRecord(
        step=7, wall_time=3.5, layers=("conv1", "fc"), total_norm=float("inf"),
        stats=np.array([[np.nan, 1, 2, 3, 4, 5, 0], [1e-300, 2, 3, 4, 5, 0, 1]]),
        histograms={"fc": bin_samples(np.linspace(-1, 1, 50), 8, "log")},
        spike_z=np.array([0.5, -1.0]), spiking=np.array([False, True]),
        nonfinite_ranks=(1, 3), origin_module="conv1", layer_detail="norms",
        rank_grad_norms=np.ones((2, 2), dtype=np.float32), dropped_steps=4,
    )  # fmt: skip
    spool = Spool.create(tmp_path, "unit", {"sink": {}}, 1 << 30)
    spool.append([original])
    (item,) = spool.read(0, 1)
    spool.close()
    back = item.payload
    assert isinstance(back, StepRecord)
    for name in ("step", "wall_time", "layers", "total_norm", "nonfinite_ranks", "layer_detail",
                 "origin_module", "dropped_steps", "layer_metrics"):  # fmt: skip
        assert getattr(back, name) == getattr(original, name), name
    for name in ("stats", "spike_z", "spiking", "rank_grad_norms"):
        np.testing.assert_array_equal(getattr(back, name), getattr(original, name))
        assert getattr(back, name).dtype == getattr(original, name).dtype
    histogram = back.histograms["fc"]
    np.testing.assert_array_equal(histogram.counts, original.histograms["fc"].counts)
    assert (histogram.scale, histogram.zeros) == ("log", original.histograms["fc"].zeros)


class _RunsCode:
    """A pickle payload that would create a file when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_a_spool_carrying_a_pickle_payload_is_a_clear_error_and_runs_nothing(
    tmp_path: Path,
) -> None:
    """A crafted item in a real spool (one a run left behind), read by `gradtrack sync`."""
    marker = tmp_path / "code-ran"
    spool = Spool.create(tmp_path / "spools", "unit", {"0-MlflowSink": _target(tmp_path)}, 1 << 30)
    spool.add_cursor("0-MlflowSink")
    spool.append([record(0)])
    path = spool.path
    spool.close()
    db = sqlite3.connect(path / "spool.db")
    db.execute("INSERT INTO items VALUES (2, 'record', 0, ?)", (pickle.dumps(_RunsCode(marker)),))
    db.commit()
    db.close()
    result = sync_cli(path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "item 2 of the spool" in result.stderr and "not an item gradtrack wrote" in result.stderr
    assert not marker.exists()
    assert path.exists()  # kept: nothing is deleted on a bad read


@pytest.mark.slow
def test_a_folder_of_pickled_frames_is_no_spool_and_runs_nothing(tmp_path: Path) -> None:
    """A spool is its sqlite database, never pickles: a folder of pickled frames (as an early
    development build wrote them) is refused without reading them."""
    marker = tmp_path / "code-ran"
    old = tmp_path / "20261130-120000-run-1-0"
    old.mkdir()
    (old / "spool.json").write_text(json.dumps({"version": 1, "sinks": {"0-MlflowSink": {}}}))
    payload = pickle.dumps(_RunsCode(marker))
    frame = struct.pack("<QII", 1, len(payload), zlib.crc32(payload)) + payload
    (old / "seg-00000000000000000001.log").write_bytes(frame)
    for named in (tmp_path, old):  # the folder of runs, or the run's folder itself
        result = sync_cli(named)
        assert result.stderr.strip() == "gradtrack: nothing to sync", result.stderr
    assert not marker.exists()


def test_a_corrupted_spool_file_is_a_clear_error(tmp_path: Path) -> None:
    spool = Spool.create(tmp_path, "unit", {"sink": {}}, 1 << 30)
    spool.append([record(0)])
    spool.close()
    (spool.path / "spool.db").write_bytes(b"garbage" * 1000)
    for leftover in spool.path.glob("spool.db-*"):
        leftover.unlink()
    with pytest.raises(SpoolError, match="not a readable gradtrack spool"):
        Spool(spool.path, 1 << 30)


def _target(tmp_path: Path) -> dict[str, object]:
    return {"backend": "mlflow", "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
            "run_id": None, "owns_run": True, "options": {}}  # fmt: skip


def test_a_spool_in_use_cannot_be_opened_twice(tmp_path: Path) -> None:
    spool = Spool.create(tmp_path, "unit", {"sink": {}}, 1 << 30)
    with pytest.raises(SpoolError, match="in use by another process"):
        Spool(spool.path, 1 << 30)
    spool.close()
    Spool(spool.path, 1 << 30).close()


@pytest.mark.slow
def test_past_its_disk_bound_the_spool_drops_counts_and_warns(
    tmp_path: Path, spool_in_tmp: Path, told: Told
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
    assert told.count("spool.mib") == 1  # told once, as one log line:
    assert not any("spool.mib" in str(w.message) for w in caught)  # not a warning too
    (kept,) = list(spool_in_tmp.iterdir())
    db = sqlite3.connect(f"file:{kept / 'spool.db'}?mode=ro", uri=True)
    (size,) = db.execute("SELECT SUM(LENGTH(body)) FROM items").fetchone()
    db.close()
    assert 1 << 19 < size <= 1 << 20  # filled to its bound, never past it
    # close gave up on the absent server, told once on the logger, with the sync command
    assert told.count(f"gradtrack sync {kept}") == 1
    assert not any("gradtrack sync" in str(w.message) for w in caught)


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_resent_items_after_a_crash_are_stored_once(tmp_path: Path) -> None:
    """A tracker may hold a batch whose confirmation never reached the disk (the process died
    in between): that spool is a copy taken before delivery, pointed at the run the first
    delivery made. Syncing it sends everything again, and the run still holds each step and
    alert once."""
    server = MlflowServer(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path).start()
    try:
        target = {**_target(tmp_path), "tracking_uri": server.uri}
        spool = Spool.create(tmp_path / "spools", "unit", {"0-MlflowSink": target}, 1 << 30)
        spool.append([*(record(step) for step in range(0, 300, 10)), event(155)])
        spool.close()
        copy = tmp_path / "copy"
        shutil.copytree(spool.path, copy, ignore=shutil.ignore_patterns("spool.lock"))
        first = sync_cli(spool.path)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "31 item(s) delivered" in first.stdout
        client = mlflow.MlflowClient(server.uri)
        (run,) = client.search_runs([client.get_experiment_by_name("gradtrack").experiment_id])
        assert stored_steps(server.uri) == list(range(0, 300, 10))
        alerts = [(a.rule, a.step) for a in read_alerts(run.info.run_id, server.uri)]
        assert alerts == [("nonfinite", 155)]
        db = sqlite3.connect(copy / "spool.db")
        sinks = {"0-MlflowSink": {**target, "run_id": run.info.run_id}}
        db.execute("UPDATE meta SET value = ? WHERE key = 'sinks'", (json.dumps(sinks),))
        db.commit()
        db.close()
        again = sync_cli(copy)
        assert again.returncode == 0, again.stdout + again.stderr
        assert stored_steps(server.uri) == list(range(0, 300, 10))  # still each once
        assert [(a.rule, a.step) for a in read_alerts(run.info.run_id, server.uri)] == alerts
        assert client.get_run(run.info.run_id).info.status == "KILLED"  # it died without a word
    finally:
        server.stop()


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_sync_of_something_that_is_no_spool_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a spool")
    result = sync_cli(tmp_path / "a-file")
    assert result.returncode == 2
    assert "neither a gradtrack spool nor a folder of spools" in result.stderr
    empty = sync_cli(tmp_path)
    assert empty.returncode == 0 and "nothing to sync" in empty.stderr


@pytest.mark.slow
@pytest.mark.parametrize("after_s", [3.0, 0.3], ids=["retrying", "worker-starting"])
def test_ctrl_c_while_close_waits_keeps_the_spool_and_says_where(
    tmp_path: Path, spool_in_tmp: Path, after_s: float
) -> None:
    """No server on the port: close waits (flush_timeout_s=120) while delivery retries; the
    user presses Ctrl-C; the interrupt goes through, and the message names the kept spool.
    Pressed as close begins, the worker process may still be starting (its imports): the
    steps not yet in its spool get there first, none is lost."""
    code = textwrap.dedent(
        f"""
        import signal, torch, gradtrack
        # Ctrl-C as at a terminal: a job started in the background (a CI runner's) inherits
        # SIGINT ignored, and Python then installs no KeyboardInterrupt for it.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        model = torch.nn.Linear(4, 1)
        watcher = gradtrack.watch(
            model, backend="mlflow", log_every=1, flush_timeout_s=120,
            mlflow={{"tracking_uri": "http://127.0.0.1:{free_port()}", "retry_max_s": 1}},
        )
        for _ in range(20):
            model(torch.randn(2, 4)).sum().backward()
        print("closing", flush=True)
        watcher.close()
        """
    )
    env = {"GRADTRACK_SPOOL_DIR": str(spool_in_tmp), "PYTHONPATH": str(REPO), "PATH": ""}
    child = subprocess.Popen(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "closing"
    time.sleep(after_s)  # close is waiting on the retries, or has just begun to wait
    started = time.monotonic()
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert time.monotonic() - started < 30  # the interrupt is not held up by the wait
    assert "KeyboardInterrupt" in err
    (kept,) = list(spool_in_tmp.iterdir())
    assert "interrupted while delivering; 20 item(s)" in err, err[-3000:]
    assert f"gradtrack sync {kept}" in err
    db = sqlite3.connect(f"file:{kept / 'spool.db'}?mode=ro", uri=True)
    assert db.execute("SELECT COUNT(*) FROM items").fetchone() == (20,)
    db.close()
