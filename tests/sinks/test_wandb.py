"""The W&B sink against the real SDK in offline mode, reading back what it wrote."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.formats.wandb import read_dir, read_parts
from gradtrack.sinks import MemorySink, WandbSink
from tests.conftest import NoUpdate, SmallCNN, Told, cnn_batch, watch_without
from tests.sinks.wandb_records import (
    history,
    of_type,
    read_records,
    run_dirs,
    run_python,
    same,
    summary,
)

wandb = pytest.importorskip("wandb")


@pytest.fixture(autouse=True)
def offline(offline_wandb: Path) -> Path:
    return offline_wandb


def wandb_options(tmp_path: Path, **more: Any) -> dict[str, Any]:
    return {"mode": "offline", "dir": str(tmp_path), "project": "gradtrack-tests", **more}


def train_cnn(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, user_log: Any = None
) -> None:
    for step in range(steps):
        images, labels = cnn_batch(seed=step)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        if step == 10:
            model[3].weight.grad[0, 0, 0, 0] = float("nan")
        optimizer.step()
        if user_log is not None:
            user_log(step, loss.item())


@pytest.mark.parametrize("user_steps", ["explicit", "implicit"])
@pytest.mark.slow
def test_offline_run_holds_every_step_histogram_alert_and_the_users_rows(
    offline: Path, user_steps: str
) -> None:
    torch.manual_seed(0)
    model = SmallCNN()
    optimizer = NoUpdate(model.parameters())  # the injected NaN stays in its own step
    run = wandb.init(project="gradtrack-tests", dir=str(offline))
    memory = MemorySink()

    def user_log(step: int, loss: float) -> None:
        if user_steps == "explicit":
            wandb.log({"user/loss": loss}, step=step)
        else:
            wandb.log({"user/loss": loss})

    with gradtrack.watch(
        model, backend=["wandb", memory], optimizer=optimizer, log_every=2,
        histograms={"every": 6, "sample_size": 500}, wandb={"profile_every": 12},
    ):  # fmt: skip
        train_cnn(model, optimizer, 24, user_log)
    run.finish()
    wandb.teardown()

    (run_dir,) = run_dirs(offline)
    records = read_records(run_dir)
    rows = history(records)
    expected = memory.scalars()
    # Every step, losslessly, in the run's step files (what gradtrack's reader reads).
    files = read_dir(run_dir / "files")
    assert files is not None
    series, file_histograms = files
    assert [r.step for r in memory.records] == list(range(0, 24, 2))
    assert set(series) == set(expected)
    for key, values in expected.items():
        assert len(series[key]) == len(values)
        assert all(a[0] == b[0] and same(a[1], b[1]) for a, b in zip(series[key], values)), key
    assert {key: [step for step, _ in entries] for key, entries in file_histograms.items()} == {
        f"grad_hist/{layer}": [0, 6, 12, 18] for layer in ("0", "3", "7")
    }
    for key, entries in file_histograms.items():
        numel = {"grad_hist/0": 448, "grad_hist/3": 4640, "grad_hist/7": 20490}[key]
        for _, histogram in entries:
            assert len(histogram.counts) == 64 and len(histogram.edges) == 65
            assert np.all(np.diff(histogram.edges) > 0)
            assert histogram.sample_size == min(numel, 500)
    # The steps that rode the user's rows carry that step's values, each step once, in order.
    ours = [row for row in rows if "gradtrack/step" in row]
    steps = [row["gradtrack/step"] for row in ours]
    assert steps and steps == sorted(set(steps)) and set(steps) <= set(range(0, 24, 2))
    for row in ours:
        for key, values in expected.items():
            value = dict(values).get(row["gradtrack/step"])
            if value is None:
                assert key not in row
            else:
                assert same(row[key], value), (key, row["gradtrack/step"])
    for row in ours:
        if "grad_hist/0.values" in row:
            assert row["gradtrack/step"] % 6 == 0
            counts = row["grad_hist/0.values"]
            assert len(counts) == 64 and sum(counts) == 448

    user_rows = [row for row in rows if "user/loss" in row]
    assert len(user_rows) == 24  # not one of the user's rows was dropped
    if user_steps == "explicit":
        assert [row["_step"] for row in user_rows] == list(range(24))

    (alert,) = [a for a in of_type(records, "alert") if "nonfinite" in a["title"]]
    assert alert["level"] == "ERROR" and alert["text"].startswith(
        "step 10: NaN gradient first at 3"
    )
    run_summary = summary(records)
    assert run_summary["gradtrack/first_nonfinite_step"] == 10
    assert run_summary["gradtrack/first_nonfinite_layer"] == "3"
    assert run_summary["gradtrack/weakest_layer"] in {"0", "3", "7"}
    metrics = {m.get("glob_name") or m.get("name"): m for m in of_type(records, "metric")}
    assert metrics["grad_norm/*"]["step_metric"] == "gradtrack/step"


@pytest.mark.slow
def test_a_rule_tripping_in_every_layer_is_one_alert_per_step(offline: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(60) for m in (nn.Linear(8, 8), nn.Sigmoid())])
    memory = MemorySink()
    vanishing = {"threshold": 1e-2, "patience": 1, "cooldown_steps": 0}
    with gradtrack.watch(
        model, backend=["wandb", memory], log_every=1, wandb=wandb_options(offline),
        alerts={"vanishing": vanishing, "jump": {"enabled": False}, "flow": {"enabled": False}},
    ):  # fmt: skip
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
    wandb.teardown()

    alerts = of_type(read_records(run_dirs(offline)[0]), "alert")
    events = [e for e in memory.events if e.rule == "vanishing"]
    assert len(events) == 3 and all(len(e.layers) > 10 for e in events)
    assert [a["title"] for a in alerts] == [e.title for e in events]
    assert alerts[0]["title"].endswith(f" and {len(events[0].layers) - 1} more layers")


@pytest.mark.slow
def test_gradtrack_starts_its_own_run_and_finishes_only_that(offline: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    config = {"wandb": wandb_options(offline, name="own-run")}
    with gradtrack.watch(model, backend="wandb", log_every=1, **config):
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
    assert wandb.run is None  # gradtrack started it, so gradtrack finished it
    wandb.teardown()
    (run_dir,) = run_dirs(offline)
    records = read_records(run_dir)
    assert of_type(records, "run")[0]["display_name"] == "own-run"
    assert [row["gradtrack/step"] for row in history(records)] == [0, 1, 2]

    run = wandb.init(project="gradtrack-tests")
    with gradtrack.watch(model, backend="wandb", log_every=1):
        model(torch.randn(2, 4)).sum().backward()
    assert wandb.run is run  # the user's run stays theirs: still active, still taking rows
    run.log({"after": 1.0})
    run.finish()


@pytest.mark.slow
def test_two_runs_in_one_process(offline: Path) -> None:
    for name in ("first", "second"):
        model = nn.Linear(3, 1)
        with gradtrack.watch(
            model, backend="wandb", log_every=1, wandb=wandb_options(offline, name=name)
        ):
            for _ in range(2):
                model(torch.randn(2, 3)).sum().backward()
    wandb.teardown()
    dirs = run_dirs(offline)
    assert len(dirs) == 2
    names = sorted(of_type(read_records(d), "run")[0]["display_name"] for d in dirs)
    assert names == ["first", "second"]
    assert all(len(history(read_records(d))) == 2 for d in dirs)


@pytest.mark.slow
def test_two_models_in_one_run_keep_their_own_keys_and_steps(offline: Path) -> None:
    generator, critic = nn.Linear(3, 3), nn.Linear(3, 1)
    run = wandb.init(project="gradtrack-tests")
    with (
        gradtrack.watch(generator, backend="wandb", log_every=1, model_name="generator"),
        gradtrack.watch(critic, backend="wandb", log_every=2, model_name="critic"),
    ):
        for _ in range(4):
            critic(generator(torch.randn(2, 3))).sum().backward()
    run.finish()
    wandb.teardown()
    (run_dir,) = run_dirs(offline)
    rows = history(read_records(run_dir))
    gen = [r["gradtrack/generator/step"] for r in rows if "gradtrack/generator/step" in r]
    crit = [r["gradtrack/critic/step"] for r in rows if "gradtrack/critic/step" in r]
    assert gen and set(gen) <= {0, 1, 2, 3} and crit and set(crit) <= {0, 2}  # charts
    folders = run_dir / "files" / "gradtrack" / "steps"
    for model, expected in {"generator": [0, 1, 2, 3], "critic": [0, 2]}.items():
        series, _ = read_parts(p.read_text() for p in (folders / model).glob("*.jsonl"))
        assert [step for step, _ in series[f"grad/{model}/total_norm"]] == expected  # every step
        assert f"grad_norm/{model}/root" in series


def test_finishing_the_run_before_closing_never_breaks_training(offline: Path, told: Told) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    run = wandb.init(project="gradtrack-tests")
    watcher = gradtrack.watch(model, backend="wandb", log_every=1)
    model(torch.randn(2, 4)).sum().backward()
    watcher.flush()
    run.finish()
    for _ in range(3):  # wandb.watch raises AttributeError here; gradtrack must not
        model(torch.randn(2, 4)).sum().backward()
    watcher.close()
    assert told.count("W&B run was finished before") == 1
    assert watcher.sink_errors["0:WandbSink"] >= 1


@pytest.mark.slow
def test_log_scale_histograms_of_bf16_gradients(offline: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).to(torch.bfloat16)
    options = wandb_options(offline)
    histograms = {"every": 1, "scale": "log", "bins": 16}
    with gradtrack.watch(model, backend="wandb", log_every=1, histograms=histograms, wandb=options):
        model(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum().backward()
    wandb.teardown()
    (row,) = history(read_records(run_dirs(offline)[0]))
    grads = torch.cat([p.grad.float().flatten() for p in model[0].parameters()])
    magnitudes = grads[grads != 0].abs().log10()
    edges = row["grad_hist/0.bins"]
    assert len(edges) == 17  # bins over log10 |g|, not g
    assert edges[0] == pytest.approx(magnitudes.min().item(), abs=1e-5)
    assert edges[-1] == pytest.approx(magnitudes.max().item(), abs=1e-5)
    assert sum(row["grad_hist/0.values"]) == magnitudes.numel()  # every non-zero element


@pytest.mark.slow
def test_missing_wandb_names_the_extra_to_install() -> None:
    assert "pip install gradtrack[wandb]" in watch_without("wandb")


@pytest.mark.slow
def test_sink_constructs_without_importing_wandb() -> None:
    code = "import sys, gradtrack; gradtrack.sinks.WandbSink(); print('wandb' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.stdout.strip() == "False", result.stderr
    assert WandbSink  # the class is part of gradtrack.sinks


@pytest.mark.slow
def test_a_watcher_never_closed_is_flushed_at_exit(offline: Path) -> None:
    code = textwrap.dedent(
        """
        import torch, gradtrack
        model = torch.nn.Linear(3, 1)
        gradtrack.watch(model, backend="wandb", log_every=1, wandb={"name": "never-closed"})
        for _ in range(5):
            model(torch.randn(2, 3)).sum().backward()
        # no close(), no wandb.finish(): exit must flush both, and not hang
        """
    )
    result = run_python(code, offline, 120)
    assert result.returncode == 0, result.stderr
    records = read_records(run_dirs(offline)[0])
    assert [row["gradtrack/step"] for row in history(records)] == [0, 1, 2, 3, 4]
    assert [e.get("exit_code", 0) for e in of_type(records, "exit")] == [0]  # run finished
