"""`GradtrackCallback` in a real `transformers.Trainer` with a tiny random GPT-2 (no download)."""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlflow
import pytest
import torch
import wandb

pytest.importorskip("transformers")
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from gradtrack.formats.tensorboard import load_events
from gradtrack.integrations.transformers import GradtrackCallback
from gradtrack.report.sources import read_tensorboard_dir, read_wandb_offline
from gradtrack.sinks.memory import MemorySink
from tests.conftest import assert_record_matches, reference_stats
from tests.sinks import wandb_records
from tests.sinks.mlflow_server import MlflowServer, free_port

STEPS = 4
ACCUMULATE = 2


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 64) -> None:
        self.ids = torch.randint(100, (n, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class GradientsSeen(TrainerCallback):  # type: ignore[misc]
    """Reference: the gradients right before the optimizer step, per watched layer; and the
    Trainer's own logs (its ``grad_norm`` is the norm before clipping)."""

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self.steps: list[dict[str, dict[str, float]]] = []
        self.logs: list[dict[str, float]] = []
        self.global_steps: list[int] = []  # the Trainer's number of each optimizer step

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any):
        self.model = model

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        assert self.model is not None
        modules = dict(self.model.named_modules())
        self.steps.append(
            {
                name: reference_stats(p.grad for p in modules[name].parameters(recurse=False))
                for name in ("transformer.wte", "transformer.h.0.attn.c_attn", "transformer.ln_f")
            }
        )

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.global_steps.append(state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
        if logs and "grad_norm" in logs:
            self.logs.append(logs)


def _train(
    tmp_path: Path,
    callback: GradtrackCallback,
    resume_from_checkpoint: str | None = None,
    callbacks: tuple[TrainerCallback, ...] = (),
    **options: Any,
) -> tuple[GradientsSeen, Trainer]:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    seen = GradientsSeen()
    arguments: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"), "max_steps": STEPS,
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": ACCUMULATE,
        "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no",
        "report_to": "none", "use_cpu": True, "disable_tqdm": True, **options,
    }  # fmt: skip
    trainer = Trainer(
        model=model, args=TrainingArguments(**arguments), train_dataset=Tokens(),
        callbacks=[callback, seen, *callbacks],
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return seen, trainer


def test_records_per_optimizer_step_keyed_by_module_names(tmp_path: Path) -> None:
    sink = MemorySink()
    callback = GradtrackCallback(sink, log_every=1, histograms=False)
    seen, _ = _train(tmp_path, callback, max_grad_norm=0.0)  # no clipping: same gradients

    assert callback.watcher is not None and callback.watcher.closed
    names = callback.watcher.layer_names
    assert "transformer.h.0.attn.c_attn" in names and "transformer.h.1.mlp.c_proj" in names
    assert "lm_head" not in names  # tied to transformer.wte: counted once, under its owner
    # A LayerNorm beside a Linear is healthy flow, not a "jump" (compared per element).
    assert [event.rule for event in sink.events if event.rule == "jump"] == []
    # One record per optimizer step (micro-batches don't count), numbered as the Trainer
    # numbers that step: its global_step.
    assert seen.global_steps == list(range(1, STEPS + 1))
    assert [r.step for r in sink.records] == seen.global_steps
    for record, expected in zip(sink.records, seen.steps):
        stats = record.layer_stats()
        assert set(expected) <= set(stats)
        picked = replace(
            record, layers=tuple(expected),
            stats=record.stats[[record.layers.index(name) for name in expected]],
        )  # fmt: skip
        assert_record_matches(picked, expected, rtol=1e-5)


def test_gradients_are_seen_before_the_trainer_clips_them(tmp_path: Path) -> None:
    sink = MemorySink()
    seen, _ = _train(
        tmp_path,
        GradtrackCallback(sink, log_every=1, histograms=False),
        max_grad_norm=0.01,
    )

    # The Trainer logs the total norm before clipping; gradtrack's total is that norm,
    # far above the 0.01 the optimizer was given.
    logged = [logs["grad_norm"] for logs in seen.logs]
    assert len(logged) == STEPS
    totals = [record.total_norm for record in sink.records]
    assert totals == pytest.approx(logged, rel=1e-5)
    assert min(totals) > 0.1


def test_the_trainers_optimizer_gives_update_ratios_and_the_learning_rate_rule(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No optimizer= anywhere: the callback watches the Trainer's AdamW (inside Accelerate's
    wrapper). Update ratios are measured once per optimizer step, a diverging learning rate
    is named, and the closing line counts the steps trained (not the last step's number)."""
    sink = MemorySink()
    with caplog.at_level("INFO", logger="gradtrack"):
        _train(
            tmp_path,
            GradtrackCallback(sink, log_every=1, histograms=False),
            learning_rate=1.0,
            max_grad_norm=0.0,
            warmup_steps=0,
        )

    assert [r.step for r in sink.records] == list(range(1, STEPS + 1))
    assert all(r.update_ratios() is not None for r in sink.records)
    # Accumulation over 2 micro-batches gives the noise scale its two batch sizes.
    assert sink.records[-1].noise_scale is not None
    (event, *_) = [e for e in sink.events if e.rule == "learning_rate"]
    assert event.step == 1 and "the learning rate is far too high" in event.message
    messages = [r.getMessage() for r in caplog.records]
    assert not any("optimizer=" in m for m in messages)
    assert f"closed after {STEPS} steps" in messages


def test_a_skip_rule_leaves_out_the_trainers_optimizer_step(tmp_path: Path) -> None:
    """``action="skip"`` through the Trainer: the step ends at the last micro-batch's
    backward, the verdict holds the Trainer's ``optimizer.step()`` back, the weights stay."""
    sink = MemorySink()
    rules = {"exploding": {"threshold": 1e-9, "action": "skip"}, "spike": {"enabled": False}}
    callback = GradtrackCallback(sink, log_every=1, histograms=False, alerts=rules,
                                 skip={"max_consecutive": STEPS + 1,
                                       "journal": tmp_path / "j.json"})  # fmt: skip
    torch.manual_seed(0)
    before = {k: v.clone() for k, v in GPT2LMHeadModel(
        GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    ).state_dict().items()}  # fmt: skip
    _, trainer = _train(tmp_path, callback)

    assert [r.skipped_by for r in sink.records] == ["exploding"] * STEPS
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_report_to_wandb_writes_into_the_trainers_run(offline_wandb: Path) -> None:
    _train(
        offline_wandb,
        GradtrackCallback(log_every=2, layer_every=1, histograms=False),
        report_to="wandb",
    )
    assert wandb.run is not None  # the Trainer leaves its run open; gradtrack does too
    wandb.finish()
    wandb.teardown()
    (run_dir,) = wandb_records.run_dirs(offline_wandb)

    rows = wandb_records.history(wandb_records.read_records(run_dir))
    assert read_wandb_offline(run_dir).steps.tolist() == [2, 4]  # the Trainer's global steps
    assert any("train/loss" in row for row in rows)  # the Trainer's own metrics, same run


class TrainerLogs(TrainerCallback):  # type: ignore[misc]
    """What the Trainer logged, in order: each dict it handed its loggers."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
        self.logs.append({**logs, "step": state.global_step})


@pytest.mark.slow
def test_at_the_trainers_default_logging_steps_every_step_is_in_its_run(
    offline_wandb: Path,
) -> None:
    """``report_to="wandb"``, ``logging_steps`` at its default (500), the callback at its
    defaults, 600 steps: every gradtrack step read back, the Trainer's rows as it logged
    them, and at its row gradtrack's newest step in the run within 2 x 500 steps."""
    steps = 600
    memory = MemorySink()
    trainer_logs = TrainerLogs()
    defaults = TrainingArguments(output_dir=str(offline_wandb / "defaults"))
    started = time.perf_counter()
    _train(
        offline_wandb, GradtrackCallback(backend=["wandb", memory]), report_to="wandb",
        max_steps=steps, gradient_accumulation_steps=1, logging_steps=defaults.logging_steps,
        callbacks=(trainer_logs,),
    )  # fmt: skip
    step_s = (time.perf_counter() - started) / steps
    wandb.finish()
    wandb.teardown()
    (run_dir,) = wandb_records.run_dirs(offline_wandb)
    rows = wandb_records.history(wandb_records.read_records(run_dir))

    logged = list(range(10, steps + 1, 10))  # log_every=10, numbered by global_step
    assert [r.step for r in memory.records] == logged
    data = read_wandb_offline(run_dir)
    assert data.steps.tolist() == logged
    assert data.total_norm.tolist() == [r.total_norm for r in memory.records]
    # The Trainer's rows: its values, one row per log, numbered 0, 1, 2 (it logs without step=).
    theirs = [row for row in rows if "train/global_step" in row]
    assert [row["_step"] for row in theirs] == list(range(len(theirs)))
    losses = [(log["step"], log["loss"]) for log in trainer_logs.logs if "loss" in log]
    assert [step for step, _ in losses] == [500]
    assert [
        (r["train/global_step"], r["train/loss"]) for r in theirs if "train/loss" in r
    ] == losses
    newest, behind = None, []
    for row in rows:
        if "gradtrack/step" in row:
            newest = max(newest or 0, row["gradtrack/step"])
        if "train/loss" in row:
            assert newest is not None
            behind.append(row["train/global_step"] - newest)
    hand_off = math.ceil(0.6 / step_s)  # one batch gathering (0.5 s) and its W&B calls
    assert max(behind) <= 2 * 500 + hand_off, behind


@pytest.mark.slow
def test_report_to_mlflow_writes_into_the_trainers_run(
    tmp_path: Path, mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "gradtrack-hf")
    _train(
        tmp_path,
        GradtrackCallback(log_every=1, layer_every=1, histograms=False),
        report_to="mlflow",
    )

    client = mlflow.MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("gradtrack-hf")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(run.info.run_id, "grad_norm/transformer.ln_f")
    loss = client.get_metric_history(run.info.run_id, "loss")  # the Trainer's, at global_step
    assert [m.step for m in history] == [m.step for m in loss] == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_report_to_tensorboard_writes_into_the_trainers_log_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``report_to="tensorboard"``: gradtrack's events land in the log dir the Trainer's
    TensorBoard callback opened (``<output_dir>/runs/<date>_<host>``), numbered by its
    global_step, as its own ``train/loss`` is."""
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    callback = GradtrackCallback(log_every=1, layer_every=1, histograms={"every": 2})
    seen, _ = _train(tmp_path, callback, report_to="tensorboard")

    (log_dir,) = {p.parent for p in (tmp_path / "out" / "runs").glob("*/*tfevents*")}
    data = read_tensorboard_dir(log_dir)
    assert data.steps.tolist() == list(range(1, STEPS + 1))
    events = load_events(log_dir)
    loss_steps = [e.step for e in events.Scalars("train/loss")]  # the Trainer's own
    assert loss_steps == data.steps.tolist()
    # The Trainer logs the total norm before it clips: gradtrack's, step by step.
    logged = [logs["grad_norm"] for logs in seen.logs]
    assert data.total_norm.tolist() == pytest.approx(logged, rel=1e-5)
    assert [s for s, _ in data.histograms["transformer.h.0.attn.c_attn"]] == [2, 4]


@pytest.mark.slow
def test_report_to_tensorboard_follows_tensorboard_logging_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    _train(tmp_path, GradtrackCallback(log_every=2, histograms=False), report_to="tensorboard")
    assert read_tensorboard_dir(tmp_path / "tb").steps.tolist() == [2, 4]


def test_a_resumed_run_continues_the_trainers_step_axis(tmp_path: Path) -> None:
    _train(tmp_path, GradtrackCallback(MemorySink()), save_strategy="steps", save_steps=2)
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert checkpoint.is_dir()

    sink = MemorySink()
    _train(
        tmp_path, GradtrackCallback(sink, log_every=1, histograms=False),
        resume_from_checkpoint=str(checkpoint),
    )  # fmt: skip
    assert [r.step for r in sink.records] == [3, 4]  # the global steps after checkpoint-2


def _two_ranks(script: str, out: Path, *args: str, **env: str) -> list[dict[str, Any]]:
    """Run ``script`` (beside this file) on 2 processes under torch's launcher, with ``out``
    and ``args``; each rank's pickled results."""
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), str(Path(__file__).with_name(script)), str(out),
         *args],
        cwd=out, env={**os.environ, "PYTHONPATH": str(root), **env},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in (0, 1)]


@pytest.mark.slow
def test_trainer_ddp_under_torchrun_rank0_writes_synchronized_gradients(tmp_path: Path) -> None:
    ranks = _two_ranks("hf_ddp.py", tmp_path)

    assert [rank["n_sinks"] for rank in ranks] == [1, 0]
    records = ranks[0]["records"]
    assert [r.step for r in records] == list(range(1, STEPS + 1))  # the Trainer's global_step
    for record, expected in zip(records, ranks[0]["seen"]):
        assert record.nonfinite_ranks == ()  # both ranks' local norms reached rank 0
        for layer, stats in expected.items():
            assert record.layer_stats()[layer].norm == pytest.approx(stats["norm"], rel=1e-6)
    assert ranks[0]["seen"] == ranks[1]["seen"]  # the all-reduced gradient, same on both


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_with_deepspeed_zero_writes_the_gradient_deepspeed_applies(
    tmp_path: Path, stage: int
) -> None:
    """``TrainingArguments(deepspeed=...)`` on 2 CPU processes, the callback as it is: one
    record per optimizer step at the Trainer's global steps, whose total is the ``grad_norm``
    the Trainer logs (DeepSpeed's global norm of the reduced gradient, before it clips)."""
    pytest.importorskip("deepspeed")
    ranks = _two_ranks("hf_deepspeed.py", tmp_path, str(stage), DS_ACCELERATOR="cpu")

    assert [rank["n_sinks"] for rank in ranks] == [1, 0]
    records = ranks[0]["records"]
    logged = ranks[0]["grad_norms"]
    assert [r.step for r in records] == [step for step, _ in logged] == list(range(1, STEPS + 1))
    assert [r.total_norm for r in records] == pytest.approx([n for _, n in logged], rel=1e-5)
    assert max(n for _, n in logged) > 1.0  # a step above max_grad_norm: seen before clipping
