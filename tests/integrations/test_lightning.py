"""`GradtrackCallback` in a real `lightning.Trainer` (CPU, a tiny model, a few steps)."""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import mlflow
import pytest
import torch
import wandb
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("lightning")
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.plugins import MixedPrecision

from gradtrack.formats.tensorboard import load_events
from gradtrack.integrations.lightning import GradtrackCallback
from gradtrack.report.sources import read_tensorboard_dir, read_wandb_offline
from gradtrack.sinks.memory import MemorySink
from gradtrack.sinks.tensorboard import TensorboardSink
from tests.conftest import assert_record_matches, reference_stats
from tests.sinks import wandb_records
from tests.sinks.mlflow_server import MlflowServer

BATCHES = 12


class TinyRegressor(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.body(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class GradientsSeen(Callback):
    """The reference: what a callback sees in ``on_before_optimizer_step`` after gradtrack's."""

    def __init__(self) -> None:
        self.steps: list[dict[str, dict[str, float]]] = []

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        body = pl_module.body
        self.steps.append(
            {f"body.{i}": reference_stats(p.grad for p in body[i].parameters()) for i in (0, 2)}
        )


def _loader(batches: int = BATCHES) -> DataLoader[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batches * 4, 6, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)


def _fit(callback: GradtrackCallback, **trainer_options: Any) -> GradientsSeen:
    torch.manual_seed(0)
    seen = GradientsSeen()
    options: dict[str, Any] = {
        "accelerator": "cpu", "max_epochs": 1, "logger": False,
        "enable_checkpointing": False, "enable_progress_bar": False,
        "enable_model_summary": False, "log_every_n_steps": 1, **trainer_options,
    }  # fmt: skip
    Trainer(callbacks=[callback, seen], **options).fit(TinyRegressor(), _loader())
    return seen


def test_one_record_per_optimizer_step_with_gradient_accumulation() -> None:
    sink = MemorySink()
    callback = GradtrackCallback(sink, log_every=1, histograms=False)
    seen = _fit(callback, accumulate_grad_batches=3)

    assert len(seen.steps) == BATCHES // 3
    assert [r.step for r in sink.records] == list(range(BATCHES // 3))
    for record, expected in zip(sink.records, seen.steps):
        assert_record_matches(record, expected)
    assert callback.watcher is not None and callback.watcher.closed
    assert sink.closed


def test_mixed_precision_gradients_are_reported_unscaled() -> None:
    sink = MemorySink()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    seen = _fit(
        GradtrackCallback(sink, log_every=1, histograms=False),
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )

    assert len(sink.records) == BATCHES
    for record, expected in zip(sink.records, seen.steps):
        assert_record_matches(record, expected, rtol=1e-5)
        assert record.amp_scale == 2.0**12  # scaled by 4096 in backward, reported unscaled
        assert record.amp_skipped is False


@pytest.mark.slow
def test_wandb_logger_run_receives_the_gradients(offline_wandb: Path) -> None:
    logger = WandbLogger(project="gradtrack-lightning", save_dir=str(offline_wandb), offline=True)
    _fit(GradtrackCallback(log_every=2, layer_every=1, histograms=False), logger=logger)
    run_dir = Path(logger.experiment.dir).parent
    wandb.finish()
    wandb.teardown()

    rows = wandb_records.history(wandb_records.read_records(run_dir))
    # Counted as Lightning counts: (step + 1) % log_every == 0, the steps Lightning logs.
    assert read_wandb_offline(run_dir).steps.tolist() == list(range(1, BATCHES, 2))
    assert any("train_loss" in row for row in rows)  # Lightning's own metrics, same run


class Paced(Callback):
    """10 ms per step: a loop the gradtrack worker keeps up with on a loaded 2-core machine
    (at full speed it falls behind there, W&B or not; see docs/wandb.md)."""

    def on_train_batch_end(self, *_: Any) -> None:
        time.sleep(0.01)


@pytest.mark.slow
def test_at_lightnings_default_log_every_n_steps_every_step_is_in_its_run(
    offline_wandb: Path,
) -> None:
    """A WandbLogger, ``log_every_n_steps`` at its default (50), the callback at its defaults:
    gradtrack logs the steps Lightning logs (49, 99, …), every one read back, Lightning's rows
    as it logged them, and at each of them gradtrack's newest step in the run within 2 x 50
    steps of training."""
    steps = 600
    memory = MemorySink()
    logger = WandbLogger(project="gradtrack-lightning", save_dir=str(offline_wandb), offline=True)
    torch.manual_seed(0)
    started = time.perf_counter()
    Trainer(
        callbacks=[GradtrackCallback(backend=["wandb", memory]), Paced()], logger=logger,
        accelerator="cpu", max_epochs=1, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    ).fit(TinyRegressor(), _loader(steps))  # fmt: skip
    step_s = (time.perf_counter() - started) / steps
    run_dir = Path(logger.experiment.dir).parent
    wandb.finish()
    wandb.teardown()
    rows = wandb_records.history(wandb_records.read_records(run_dir))

    logged = list(range(49, steps, 50))  # Lightning's log_every_n_steps, as Lightning counts
    assert [r.step for r in memory.records] == logged
    data = read_wandb_offline(run_dir)
    assert data.steps.tolist() == logged
    assert data.total_norm.tolist() == [r.total_norm for r in memory.records]
    # Lightning's rows: every 50th step, numbered 0, 1, 2 (it logs without step=).
    theirs = [row for row in rows if "train_loss" in row]
    assert [row["trainer/global_step"] for row in theirs] == list(range(49, steps, 50))
    assert [row["_step"] for row in theirs] == list(range(len(theirs)))
    newest, behind = None, []
    for row in rows:
        if "gradtrack/step" in row:
            newest = max(newest or 0, row["gradtrack/step"])
        if "train_loss" in row and newest is not None:
            behind.append(row["trainer/global_step"] - newest)
    hand_off = math.ceil(0.6 / step_s)  # one batch gathering (0.5 s) and its W&B calls
    assert behind and max(behind) <= 2 * 50 + hand_off, (behind, hand_off)


@pytest.mark.slow
def test_mlflow_logger_run_receives_the_gradients(mlflow_server: MlflowServer) -> None:
    logger = MLFlowLogger(experiment_name="gradtrack-lightning", tracking_uri=mlflow_server.uri)
    _fit(
        GradtrackCallback(log_every=3, layer_every=1, histograms=False),
        logger=logger,
        log_every_n_steps=3,
    )

    client = mlflow.MlflowClient(mlflow_server.uri)
    history = client.get_metric_history(logger.run_id, "grad_norm/body.2")
    assert [m.step for m in history] == list(range(2, BATCHES, 3))
    lightnings = client.get_metric_history(logger.run_id, "train_loss")
    assert [m.step for m in lightnings] == [2, 5, 8, 11]  # log_every_n_steps=3: the same
    assert client.get_metric_history(logger.run_id, "train_loss")


@pytest.mark.slow
def test_tensorboard_logger_writer_receives_the_gradients(tmp_path: Path) -> None:
    """A TensorBoardLogger: gradtrack writes through its SummaryWriter, into its version's
    log dir, at Lightning's global steps, beside Lightning's own scalars."""
    logger = TensorBoardLogger(save_dir=str(tmp_path), name="tiny")
    callback = GradtrackCallback(log_every=2, layer_every=1, histograms={"every": 4})
    seen = _fit(callback, logger=logger)
    assert callback.watcher is not None
    (sink,) = callback.watcher.sinks
    assert isinstance(sink, TensorboardSink) and sink.writer is logger.experiment
    logger.finalize("success")

    log_dir = Path(logger.log_dir)  # tiny/version_0
    assert log_dir.name == "version_0"
    data = read_tensorboard_dir(log_dir)
    assert data.steps.tolist() == list(range(1, BATCHES, 2))
    assert data.layers == ["body.0", "body.2"]
    for row, step in enumerate(data.steps.tolist()):
        expected = [seen.steps[step][layer]["norm"] for layer in data.layers]
        assert data.norms[row].tolist() == pytest.approx(expected, rel=1e-6)
    assert [s for s, _ in data.histograms["body.0"]] == [3, 7, 11]
    assert "train_loss" in load_events(log_dir).Tags()["scalars"]  # Lightning's, same dir


class DivergingRegressor(TinyRegressor):
    """Adam at a learning rate of 1: its first update redraws the weights."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1.0)


def test_the_trainers_optimizer_gives_update_ratios_and_the_learning_rate_rule(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No optimizer= anywhere: the callback takes Lightning's. Update ratios are measured,
    the learning-rate rule names a diverging rate, and nothing asks for optimizer=."""
    sink = MemorySink()
    torch.manual_seed(0)
    with caplog.at_level("INFO", logger="gradtrack"):
        Trainer(
            callbacks=[GradtrackCallback(sink, log_every=1, histograms=False)],
            accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        ).fit(DivergingRegressor(), _loader())  # fmt: skip

    assert [r.step for r in sink.records] == list(range(BATCHES))
    assert all(r.update_ratios() is not None for r in sink.records)
    ratios = sink.records[0].update_ratios()
    assert ratios is not None and min(ratios) > 1  # Adam moves each weight by ~lr at first
    (event, *_) = [e for e in sink.events if e.rule == "learning_rate"]
    assert event.step == 0 and "the learning rate is far too high" in event.message
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("watching 2 layers") for m in messages), messages  # (captured)
    assert not any("optimizer=" in m for m in messages)


def test_a_skip_rule_leaves_out_lightnings_optimizer_step(tmp_path: Path) -> None:
    """``action="skip"`` on the Lightning route: the optimizer's step (given Lightning's
    closure, which makes the gradients) is left out where the rule trips, and the weights
    stay as they were; the other steps update them."""

    class Recorded(TinyRegressor):
        def __init__(self) -> None:
            super().__init__()
            self.weights: list[torch.Tensor] = []

        def on_train_batch_end(self, *_: Any) -> None:
            self.weights.append(self.body[0].weight.detach().clone())

    sink = MemorySink()
    rules = {"exploding": {"threshold": 1e-9, "action": "skip"}, "spike": {"enabled": False}}
    model = Recorded()
    before = model.body[0].weight.detach().clone()
    skip = {"max_consecutive": 3, "journal": tmp_path / "j.json"}
    callback = GradtrackCallback(sink, log_every=1, histograms=False, alerts=rules, skip=skip)
    torch.manual_seed(0)
    with pytest.raises(Exception, match="consecutive"):
        Trainer(
            callbacks=[callback], accelerator="cpu", max_epochs=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        ).fit(model, _loader())  # fmt: skip
    # Every step trips (threshold 1e-9): three are skipped, the fourth raises.
    assert len(model.weights) == 3
    assert all(torch.equal(w, before) for w in model.weights)
    assert [r.skipped_by for r in sink.records][:3] == ["exploding"] * 3


def test_lightnings_rows_and_gradtracks_land_on_the_same_steps(tmp_path: Path) -> None:
    """At the defaults, gradtrack logs where Lightning logs: ``log_every_n_steps=5`` over 24
    steps puts both on steps 4, 9, 14, 19 (Lightning's CSV rows read back)."""
    sink = MemorySink()
    logger = CSVLogger(tmp_path, name="csv")
    torch.manual_seed(0)
    Trainer(
        callbacks=[GradtrackCallback(sink, histograms=False)], logger=logger,
        accelerator="cpu", max_epochs=1, log_every_n_steps=5, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    ).fit(TinyRegressor(), _loader(24))  # fmt: skip
    logger.finalize("success")

    lines = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    lightnings = [int(line.split(",")[header.index("step")]) for line in lines[1:]]
    assert lightnings == [4, 9, 14, 19]
    assert [r.step for r in sink.records] == lightnings


def test_other_loggers_fall_back_to_the_console(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    callback = GradtrackCallback(log_every=4, histograms=False, console={"interval_s": 0})
    _fit(callback, logger=CSVLogger(tmp_path))

    assert callback.watcher is not None
    assert [type(sink).__name__ for sink in callback.watcher.sinks] == ["ConsoleSink"]
    assert "body.0" in capsys.readouterr().out


def test_bad_options_fail_when_the_callback_is_made() -> None:
    with pytest.raises(Exception, match="log_every"):
        GradtrackCallback(log_every=0)


@pytest.mark.slow
def test_lightning_ddp_two_processes_rank0_writes_synchronized_gradients(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("lightning_ddp.py")), str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in (0, 1)]

    assert [rank["n_sinks"] for rank in ranks] == [1, 0]
    records = ranks[0]["records"]
    assert [r.step for r in records] == [0, 1, 2, 3]
    for record, expected in zip(records, ranks[0]["seen"]):
        assert_record_matches(record, expected)
        assert record.nonfinite_ranks == ()  # both ranks' local norms reached rank 0
    # DDP averaged the two ranks' different batches: rank 1 saw the same gradients.
    assert ranks[0]["seen"] == ranks[1]["seen"]


def test_a_resumed_fit_continues_the_trainers_step_axis(tmp_path: Path) -> None:
    _fit(GradtrackCallback(MemorySink()), enable_checkpointing=True,
         default_root_dir=str(tmp_path))  # fmt: skip
    (saved,) = tmp_path.rglob("*.ckpt")
    checkpoint = saved.rename(tmp_path / "resume.ckpt")  # an empty checkpoints/ for the next fit

    sink = MemorySink()
    torch.manual_seed(0)
    Trainer(
        accelerator="cpu", max_steps=BATCHES + 4, logger=False, default_root_dir=str(tmp_path),
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[GradtrackCallback(sink, log_every=1, histograms=False)],
    ).fit(TinyRegressor(), _loader(), ckpt_path=str(checkpoint))  # fmt: skip
    # One epoch (12 steps) was done: the resumed fit's records continue at step 12.
    assert [r.step for r in sink.records] == list(range(BATCHES, BATCHES + 4))
