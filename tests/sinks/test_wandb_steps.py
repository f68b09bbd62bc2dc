"""gradtrack never moves the user's W&B steps: real SDK, offline, read back from the run file."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.sinks import MemorySink
from gradtrack.sinks import wandb_rows as wandb_sink
from tests.sinks.wandb_records import history, read_records, run_dirs, summary

wandb = pytest.importorskip("wandb")

STEPS = 150


@pytest.fixture(autouse=True)
def offline(offline_wandb: Path) -> Path:
    return offline_wandb


def backward(model: nn.Module) -> float:
    model.zero_grad()
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    return loss.item()


def read_back(offline: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    wandb.teardown()  # the run file is complete only once W&B's service is gone
    records = read_records(run_dirs(offline)[0])
    return history(records), summary(records)


@pytest.mark.parametrize("user_steps", ["explicit", "implicit"])
def test_every_user_row_and_every_gradtrack_step_when_flushed_between_steps(
    offline: Path, user_steps: str
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    run = wandb.init(project="gradtrack-tests")
    with gradtrack.watch(model, backend="wandb", log_every=1) as watcher:
        for step in range(STEPS):
            loss = backward(model)
            if user_steps == "explicit":
                run.log({"loss": loss}, step=step)  # opens row `step`, commits the one before
                watcher.flush()  # gradtrack's step rides the open row
            else:
                watcher.flush()  # gradtrack's step waits in the open row
                run.log({"loss": loss})  # the user's log commits it
    run.finish()

    rows, run_summary = read_back(offline)
    user_rows = [row for row in rows if "loss" in row]
    assert [row["_step"] for row in user_rows] == list(range(STEPS))
    assert len(rows) == STEPS and rows[-1]["_step"] == STEPS - 1  # no row of gradtrack's own
    # Each gradtrack step rode the user's row of the same step.
    assert [row.get("gradtrack/step") for row in rows] == list(range(STEPS))
    assert all("grad/total_norm" in row for row in rows)
    assert run_summary.get("gradtrack/coalesced", 0) == 0


@pytest.mark.parametrize("user_steps", ["explicit", "implicit"])
@pytest.mark.parametrize(
    ("steps", "pause_s"),
    [(STEPS, 0.0), (600, 0.003)],  # paced: steps ride rows while the user commits others
)
def test_a_real_loop_never_loses_a_user_row_nor_overwrites_a_step(
    offline: Path, user_steps: str, steps: int, pause_s: float
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    run = wandb.init(project="gradtrack-tests")
    memory = MemorySink()  # what reached the sinks (gradtrack's queue may drop steps first)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradtrack.watch(model, backend=["wandb", memory], log_every=1):
            for step in range(steps):
                time.sleep(pause_s)
                loss = backward(model)
                if user_steps == "explicit":
                    run.log({"loss": loss}, step=step)
                else:
                    run.log({"loss": loss})
        run.finish()

    rows, run_summary = read_back(offline)
    user_rows = [row for row in rows if "loss" in row]
    assert [row["_step"] for row in user_rows] == list(range(steps))
    assert rows[: len(user_rows)] == user_rows  # gradtrack's own rows, if any, only after
    ours = [row["gradtrack/step"] for row in rows if "gradtrack/step" in row]
    assert ours == sorted(set(ours))  # in order, each once
    coalesced = run_summary.get("gradtrack/coalesced", 0)
    delivered = [record.step for record in memory.records]
    assert set(ours) <= set(delivered)
    assert len(ours) + coalesced == len(delivered)  # what is missing is counted
    left_out = [w for w in caught if "steps out of the W&B run" in str(w.message)]
    assert bool(left_out) == (coalesced > 0)


def user_logs_every_tenth_step(run: Any) -> None:
    """gradtrack logs every step; the user logs ``loss`` with ``step=`` every 10th."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    with gradtrack.watch(model, backend="wandb", log_every=1) as watcher:
        for step in range(STEPS):
            backward(model)
            if step % 10 == 9:
                watcher.flush()
                run.log({"loss": float(step)}, step=step)


def test_steps_the_user_has_no_rows_for_wait_for_the_finish(offline: Path) -> None:
    """The user logs every 10th step, gradtrack every step: one gradtrack step per user row,
    the rest in order in rows of gradtrack's own once the user finishes the run."""
    run = wandb.init(project="gradtrack-tests")
    user_logs_every_tenth_step(run)
    run.finish()

    rows, run_summary = read_back(offline)
    user_rows = [row for row in rows if "loss" in row]
    assert [row["_step"] for row in user_rows] == list(range(9, STEPS, 10))
    assert rows[-1]["_step"] > user_rows[-1]["_step"]  # gradtrack's own rows came last
    assert all("gradtrack/step" in row for row in rows[rows.index(user_rows[-1]) + 1 :])
    ours = [row["gradtrack/step"] for row in rows if "gradtrack/step" in row]
    assert ours == list(range(STEPS))
    assert "gradtrack/coalesced" not in run_summary


def test_steps_beyond_the_waiting_limit_are_counted_not_hidden(
    offline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wandb_sink, "PENDING_LIMIT", 8)
    run = wandb.init(project="gradtrack-tests")
    with pytest.warns(RuntimeWarning, match="steps out of the W&B run"):
        user_logs_every_tenth_step(run)
        run.finish()

    rows, run_summary = read_back(offline)
    user_rows = [row for row in rows if "loss" in row]
    assert [row["_step"] for row in user_rows] == list(range(9, STEPS, 10))
    ours = [row["gradtrack/step"] for row in rows if "gradtrack/step" in row]
    assert ours == sorted(set(ours))
    assert run_summary["gradtrack/coalesced"] == STEPS - len(ours) > 0


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
    rows, _ = read_back(offline)
    assert [row["gradtrack/step"] for row in rows[:5]] == [0, 1, 2, 3, 4]  # own rows
    user_rows = [row for row in rows if "loss" in row]
    assert [row["_step"] for row in user_rows] == list(range(5, 10))  # none refused
    ours = [row["gradtrack/step"] for row in rows if "gradtrack/step" in row]
    assert ours == list(range(10))
