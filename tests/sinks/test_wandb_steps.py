"""gradtrack in the user's own W&B run, at any cadence of the user's logging: every step in the
run, charts current, the user's rows untouched. Real SDK, offline, the run file read back."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.config import DeliveryOptions
from gradtrack.report.sources import read_wandb_offline
from gradtrack.sinks import MemorySink
from tests.sinks.wandb_records import history, read_records, run_dirs

wandb = pytest.importorskip("wandb")

NEVER = 0  # the user logs nothing while training, one row after it


@pytest.fixture(autouse=True)
def offline(offline_wandb: Path) -> Path:
    return offline_wandb


def backward(model: nn.Module) -> None:
    model.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()


@dataclass
class Loop:
    rows: list[dict[str, Any]]
    memory: MemorySink
    run_dir: Path
    step_s: float  # seconds per training step, measured


def train_beside_the_user(
    offline: Path, steps: int, every: int, explicit: bool, log_every: int, pause_s: float
) -> Loop:
    """A training loop whose user logs ``loss`` (= the step) every ``every``-th step, with
    ``step=`` or without, into their own run; gradtrack watches with ``log_every``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    run = wandb.init(project="gradtrack-tests")
    memory = MemorySink()  # what reached the sinks: every logged step
    started = time.perf_counter()
    with gradtrack.watch(model, backend=["wandb", memory], log_every=log_every):
        for step in range(steps):
            time.sleep(pause_s)
            backward(model)
            if every and step % every == every - 1:
                run.log({"loss": float(step)}, step=step if explicit else None)
    step_s = (time.perf_counter() - started) / steps
    run.log({"loss": float(steps)}, step=steps if explicit else None)  # after training
    run.finish()
    wandb.teardown()  # the run file is complete only once W&B's service is gone
    (run_dir,) = run_dirs(offline)
    return Loop(history(read_records(run_dir)), memory, run_dir, step_s)


def user_rows_untouched(loop: Loop, steps: int, every: int, explicit: bool) -> None:
    """Every row the user logged, with its value, at the ``_step`` it would have without
    gradtrack: the user's steps with ``step=``, 0, 1, 2, ... without."""
    logged = [*([s for s in range(steps) if s % every == every - 1] if every else []), steps]
    user_rows = [row for row in loop.rows if "loss" in row]
    assert [row["loss"] for row in user_rows] == [float(s) for s in logged]
    expected_steps = logged if explicit else list(range(len(logged)))
    assert [row["_step"] for row in user_rows] == expected_steps
    # Rows that are not the user's hold only gradtrack's keys: at most the one open before
    # the user's first row (with step=) or after their last (without), never one between.
    others = [row for row in loop.rows if "loss" not in row]
    assert all("gradtrack/step" in row for row in others)
    assert len(others) <= 1


def every_step_read_back(loop: Loop, steps: int, log_every: int) -> None:
    """gradtrack's reader finds every logged step, with the values the sinks were handed."""
    data = read_wandb_offline(loop.run_dir)
    assert data.steps.tolist() == list(range(0, steps, log_every))
    assert [r.step for r in loop.memory.records] == data.steps.tolist()
    assert data.total_norm.tolist() == [r.total_norm for r in loop.memory.records]
    ours = [row["gradtrack/step"] for row in loop.rows if "gradtrack/step" in row]
    assert ours == sorted(set(ours)) and set(ours) <= set(data.steps.tolist())
    # The newest step rode the row open at the end (or, if that row held a step with more
    # keys, the newest of those: histograms every 100 steps, per-layer statistics every
    # layer_every logged steps).
    assert ours[-1] >= data.steps[-1] - 100


def staleness(loop: Loop, explicit: bool) -> list[int]:
    """At each user row while training: how many steps the newest gradtrack step in the run
    (rows up to and including it) is behind the step the user logged the row at. Rows before
    gradtrack's first step reached the run are left out (that hand-off also starts W&B)."""
    newest = None
    behind = []
    for row in loop.rows:
        if "gradtrack/step" in row:
            newest = row["gradtrack/step"] if newest is None else max(newest, row["gradtrack/step"])
        if "loss" in row and newest is not None:
            behind.append(int(row["_step"] if explicit else row["loss"]) - newest)
    return behind[:-1]  # the last row is logged after training


def hand_off_steps(step_s: float, log_every: int) -> int:
    """Steps trained while one batch gathers in gradtrack's worker (``delivery.batch_wait_s``,
    or ``max_batch_steps`` logged steps), plus 0.25 s for the W&B calls that place it on a
    shared 2-core machine (W&B's service process competes with training for the cores)."""
    delivery = DeliveryOptions()
    gather = min(delivery.max_batch_steps * log_every, math.ceil(delivery.batch_wait_s / step_s))
    return gather + math.ceil(0.25 / step_s)


CADENCES = [1, 10, 100, NEVER]


@pytest.mark.parametrize("log_every", [1, 10])
@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "implicit"])
@pytest.mark.parametrize("every", CADENCES, ids=lambda e: f"user-every-{e}" if e else "never")
@pytest.mark.slow
@pytest.mark.solo  # the charts' staleness is measured against the loop's pace
def test_at_10ms_per_step_every_step_is_in_the_run_and_charts_stay_current(
    offline: Path, every: int, explicit: bool, log_every: int
) -> None:
    steps = 500
    loop = train_beside_the_user(offline, steps, every, explicit, log_every, pause_s=0.01)
    user_rows_untouched(loop, steps, every, explicit)
    every_step_read_back(loop, steps, log_every)
    behind = staleness(loop, explicit)
    bound = 2 * max(every, log_every) + hand_off_steps(loop.step_s, log_every)
    assert max(behind, default=0) <= bound, (sorted(behind)[-5:], bound, loop.step_s)


@pytest.mark.parametrize("log_every", [1, 10])
@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "implicit"])
@pytest.mark.parametrize("every", CADENCES, ids=lambda e: f"user-every-{e}" if e else "never")
@pytest.mark.slow
def test_at_full_speed_every_step_is_in_the_run_and_the_users_rows_untouched(
    offline: Path, every: int, explicit: bool, log_every: int
) -> None:
    steps = 1500
    loop = train_beside_the_user(offline, steps, every, explicit, log_every, pause_s=0.0)
    user_rows_untouched(loop, steps, every, explicit)
    every_step_read_back(loop, steps, log_every)


@pytest.mark.slow
def test_a_run_of_gradtracks_own_gets_a_row_per_step_until_the_user_logs_too(
    offline: Path,
) -> None:
    model = nn.Linear(8, 1)
    options = {"mode": "offline", "dir": str(offline), "project": "gradtrack-tests"}
    with gradtrack.watch(model, backend="wandb", log_every=1, wandb=options) as watcher:
        for _ in range(5):
            backward(model)
        watcher.flush()
        run = wandb.run
        assert run is not None
        for step in range(5, 10):
            run.log({"loss": float(step)}, step=step)  # the user logs into gradtrack's run
            backward(model)
            watcher.flush()
    wandb.teardown()
    (run_dir,) = run_dirs(offline)
    rows = history(read_records(run_dir))
    assert [row["gradtrack/step"] for row in rows[:5]] == [0, 1, 2, 3, 4]  # own rows
    user_rows = [row for row in rows if "loss" in row]
    assert [row["_step"] for row in user_rows] == list(range(5, 10))  # none refused
    ours = [row["gradtrack/step"] for row in rows if "gradtrack/step" in row]
    assert ours == list(range(10))  # flushed after each step: each rode the user's row
    assert read_wandb_offline(run_dir).steps.tolist() == list(range(10))


def _tables(run_dir: Path) -> int:
    """Tables W&B wrote for the run's rows (one per profile logged)."""
    return len(list((run_dir / "files" / "media" / "table").rglob("*.json")))


@pytest.mark.parametrize("media_every_s", [0.5, None])
def test_steps_handed_on_faster_than_media_every_s_ride_the_users_row_without_their_media(
    offline: Path, media_every_s: float | None
) -> None:
    """W&B's SDK spends 2-3 ms of the training process on each histogram or profile table a
    row carries. Sixty real steps, each with histograms and a profile every other step,
    handed to the sink one per batch (as a fast loop does) in a user's run nobody commits to:
    a table reaches the open row at most once per ``wandb.media_every_s`` — counted in the
    run's media files — and at close the newest step held back rides with its histograms.
    With None each of the 30 is logged (the cost this bounds)."""
    from gradtrack.config import GradtrackConfig
    from gradtrack.sinks import WandbSink

    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    memory = MemorySink()
    with gradtrack.watch(
        model, backend=memory, log_every=1, layer_every=1, histograms={"every": 2}
    ):  # fmt: skip
        for _ in range(60):
            backward(model)
    run = wandb.init(project="gradtrack-tests")
    config = GradtrackConfig(wandb={"profile_every": 2, "media_every_s": media_every_s})
    sink = WandbSink(config, run)
    started = time.perf_counter()
    for record in memory.records:
        sink.write([record])
    elapsed = time.perf_counter() - started
    sink.close()
    run.finish()
    wandb.teardown()
    (run_dir,) = run_dirs(offline)
    if media_every_s is None:
        assert _tables(run_dir) == 30
    else:
        assert 1 <= _tables(run_dir) <= elapsed / media_every_s + 2
    (row,) = history(read_records(run_dir))  # (the one row, committed at finish)
    assert row["gradtrack/step"] == 58  # (59 has no histograms: it may not replace 58's)
    assert row["grad_hist/0.values"] == memory.records[58].histograms["0"].counts.tolist()


@pytest.mark.slow
def test_in_a_run_of_its_own_every_step_is_a_row_and_media_ride_at_most_once_per_half_second(
    offline: Path,
) -> None:
    """gradtrack's own run at log_every=1, histograms every 5 steps, at full speed: a row per
    step, each with its own step's scalars; histograms in at most one row per half second
    (the default ``wandb.media_every_s``), each the histogram of its row's step as the step
    files hold it, which hold all of them."""
    from gradtrack.formats.wandb import read_dir

    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    options = {"mode": "offline", "dir": str(offline), "project": "gradtrack-tests"}
    started = time.perf_counter()
    with gradtrack.watch(
        model, backend="wandb", log_every=1, histograms={"every": 5}, wandb=options
    ):  # fmt: skip
        for _ in range(1000):
            backward(model)
    elapsed = time.perf_counter() - started
    wandb.teardown()
    (run_dir,) = run_dirs(offline)
    rows = history(read_records(run_dir))
    assert [row["gradtrack/step"] for row in rows] == list(range(1000))
    files = read_dir(run_dir / "files")
    assert files is not None
    _, histograms = files
    in_files = dict(histograms["grad_hist/0"])
    assert sorted(in_files) == list(range(0, 1000, 5))
    with_media = [row for row in rows if "grad_hist/0.values" in row]
    assert 1 <= len(with_media) <= elapsed / 0.5 + 1
    for row in with_media:
        assert row["grad_hist/0.values"] == in_files[row["gradtrack/step"]].counts.tolist()
