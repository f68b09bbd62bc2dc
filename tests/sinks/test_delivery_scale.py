"""Delivery at the scale of real runs: thousands of steps at ``log_every=1`` in a tight loop,
the default histograms, a cold embedded store — every step stored when `close()` returns, and
a trainer killed mid-run loses at most its last second (`gradtrack sync` delivers the rest,
each step once)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradtrack.formats.mlflow import read_histograms

pytestmark = pytest.mark.solo  # timing promises: run alone (scripts/test.sh)

mlflow = pytest.importorskip("mlflow")

REPO = Path(__file__).resolve().parents[2]
HISTOGRAM_EVERY = 100  # the default histograms.every


def child(uri: str, steps: int, progress: Path, spools: Path) -> subprocess.Popen[str]:
    env = {"GRADTRACK_SPOOL_DIR": str(spools), "PYTHONPATH": str(REPO), "PATH": ""}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.sinks.scale_child", uri, str(steps), str(progress)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def the_run(uri: str) -> str:
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gradtrack").experiment_id])
    return str(run.info.run_id)


def stored(uri: str, run_id: str) -> list[int]:
    history = mlflow.MlflowClient(uri).get_metric_history(run_id, "grad/total_norm")
    return sorted(m.step for m in history)


def finished_before(progress: Path, moment: float) -> list[int]:
    """The steps the child reported finished (``step time`` lines) before ``moment``."""
    lines = progress.read_text().splitlines() if progress.exists() else []
    done = [line.split() for line in lines if line.count(" ") == 1]
    return [int(step) for step, at in done if float(at) < moment]


@pytest.mark.slow
def test_6000_steps_at_log_every_1_into_a_cold_sqlite_file_are_all_stored_at_close(
    tmp_path: Path,
) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spools = tmp_path / "spools"
    process = child(uri, 6000, tmp_path / "progress", spools)
    out, err = process.communicate(timeout=900)
    assert process.returncode == 0 and "closed run" in out, err[-3000:]
    assert "no progress" not in err and "gradtrack sync" not in err, err[-3000:]
    run_id = the_run(uri)
    assert stored(uri, run_id) == list(range(6000))  # every step, each once
    histograms = read_histograms(run_id, uri)
    assert histograms, "no histograms stored"
    for series in histograms.values():
        assert [step for step, _ in series] == list(range(0, 6000, HISTOGRAM_EVERY))
    assert not spools.exists() or not any(spools.iterdir())  # delivered: no spool left
    print(out.strip())


@pytest.mark.slow
def test_a_trainer_killed_mid_run_loses_at_most_its_last_second_and_sync_delivers_the_rest(
    tmp_path: Path,
) -> None:
    """SIGKILL (no close, no exit hook) a few thousand steps into a tight loop at
    ``log_every=1``; then `gradtrack sync` with no argument (every spool on the machine)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spools, progress = tmp_path / "spools", tmp_path / "progress"
    process = child(uri, 1_000_000, progress, spools)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and process.poll() is None:
            # kill once 3,000 steps finished more than 1.5 s ago: a fast loop runs
            # thousands of steps in the second the kill may take from them
            if len(finished_before(progress, time.time() - 1.5)) >= 3000:
                break
            time.sleep(0.2)
        killed_at = time.time()
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.kill()
        process.communicate()
    done = finished_before(progress, float("inf"))
    finished = finished_before(progress, killed_at - 1.0)
    assert len(finished) >= 3000, f"only {len(finished)} steps before the kill"
    env = {"GRADTRACK_SPOOL_DIR": str(spools), "PYTHONPATH": str(REPO), "PATH": ""}
    synced = subprocess.run(
        [sys.executable, "-m", "gradtrack.cli", "sync"], env=env, cwd=tmp_path,
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert synced.returncode == 0, synced.stdout + synced.stderr
    run_id = the_run(uri)
    steps = stored(uri, run_id)
    assert len(steps) == len(set(steps))  # each once
    missing = sorted(set(finished) - set(steps))
    assert not missing, f"{len(missing)} finished steps not stored, first {missing[:5]}"
    histograms = read_histograms(run_id, uri)
    last = max(finished)
    for series in histograms.values():
        got = [step for step, _ in series]
        assert len(got) == len(set(got))
        assert set(range(0, last + 1, HISTOGRAM_EVERY)) <= set(got)
    assert not any(spools.iterdir())  # delivered: the spool is gone
    print(f"killed after {len(done)} steps; {len(steps)} stored; {synced.stdout.strip()}")
