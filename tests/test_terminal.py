"""What a user sees in the terminal with the defaults: each alert once, tables that keep clear
of progress bars."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.errors import GradientWarning
from gradtrack.sinks import ConsoleSink, MemorySink

ROOT = Path(__file__).resolve().parents[1]


def train_scaled(
    scale: float, nan_from: int | None, steps: int = 25, **overrides: object
) -> MemorySink:
    """``steps`` optimizer steps with the defaults (log_every=10), the loss times ``scale``,
    and the first layer's gradient NaN from step ``nan_from`` on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    sink = MemorySink()
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, **overrides):
        for step in range(steps):
            optimizer.zero_grad()
            (model(torch.randn(4, 8)).pow(2).mean() * scale).backward()
            if nan_from is not None and step >= nan_from:
                model[0].weight.grad[0, 0] = float("nan")
            optimizer.step()
    return sink


def gradtrack_records(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "gradtrack"]


def test_default_actions_log_each_event_once_per_cooldown_at_its_severity(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gradtrack")
    train_scaled(1.0, nan_from=13)  # NaN at every step from 13 on: one event (cooldown 100)
    errors = [m for level, m in gradtrack_records(caplog) if level == logging.ERROR]
    assert len(errors) == 1 and "NaN gradient" in errors[0]
    caplog.clear()
    # Above the exploding threshold at every logged step (0, 10, 20): the layers' event and
    # the total norm's, at step 0 only (cooldown 100), one record each.
    sink = train_scaled(1e7, nan_from=None)
    warnings = [m for level, m in gradtrack_records(caplog) if level == logging.WARNING]
    assert [(e.rule, e.step) for e in sink.events] == [("exploding", 0)] * 2
    assert warnings == [e.message for e in sink.events]


def test_warn_action_warns_once_and_logs_nothing_more(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gradtrack")
    with pytest.warns(GradientWarning) as caught:
        train_scaled(1.0, nan_from=13, alerts={"nonfinite": {"action": "warn"}})
    assert len([w for w in caught if issubclass(w.category, GradientWarning)]) == 1
    assert [m for level, m in gradtrack_records(caplog) if level >= logging.WARNING] == []


@pytest.mark.parametrize("backend", ["console", "memory"])
@pytest.mark.slow
def test_a_script_shows_a_nan_alert_once_whatever_the_backend(tmp_path: Path, backend: str) -> None:
    code = textwrap.dedent(
        f"""
        import torch, gradtrack
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        with gradtrack.watch(model, {backend!r}, optimizer=optimizer):  # log_every=10
            for step in range(25):
                optimizer.zero_grad()
                model(torch.randn(4, 8)).pow(2).mean().backward()
                if step >= 13:
                    model[0].weight.grad[0, 0] = float("nan")
                optimizer.step()
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADTRACK_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    terminal = done.stdout + done.stderr
    assert terminal.count("NaN gradient") == 1, terminal
    assert "[gradtrack] watching 2 layers of Sequential, every 10 steps, into " in done.stderr
    if backend == "console":
        assert "gradtrack step 13: total gradient norm nan" in done.stdout  # the table too


def test_console_tables_keep_clear_of_a_tqdm_bar() -> None:
    tqdm = pytest.importorskip("tqdm")
    stream = io.StringIO()
    model = nn.Linear(4, 1)
    with tqdm.tqdm(total=3, file=stream, ascii=True) as bar:
        sink = ConsoleSink(interval_s=0.0, stream=stream)
        with gradtrack.watch(model, backend=sink, log_every=1):
            for _ in range(3):
                model(torch.randn(2, 4)).sum().backward()
                bar.update()
    for line in stream.getvalue().replace("\r", "\n").splitlines():
        assert "gradtrack step" not in line or line.startswith("gradtrack step"), line


@pytest.mark.slow
def test_the_close_progress_line_names_what_it_waits_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A tight loop at log_every=1 into MLflow's store, closed with steps still to deliver: each
    progress line names the kinds left and their counts, or, with every item delivered, what
    the sink is doing — never "0 item(s) left" with a rate and a time to go."""
    from gradtrack.delivery import courier as progress

    monkeypatch.setattr(progress, "_LINE_EVERY_S", 0.2)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    watcher = gradtrack.watch(
        model, backend="mlflow", optimizer=optimizer, log_every=1,
        mlflow={"tracking_uri": uri}, spool={"dir": str(tmp_path / "spool")},
    )  # fmt: skip
    for _ in range(1500):  # no sleep: the courier falls behind
        optimizer.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
    with caplog.at_level(logging.INFO, logger="gradtrack"):
        watcher.close()
    lines = [m for m in caplog.messages if m.startswith("delivering to MlflowSink")]
    assert lines, "close took under 0.2 s: nothing to show"
    for line in lines:
        assert "0 item(s)" not in line, line
        assert ("step(s) of" in line and "left" in line) or "every item delivered, " in line, line
    done_lines = [m for m in lines if "every item delivered" in m]
    doing = [*progress._DOING.values(), "closing the run's spool"]  # a close may flush first
    assert all(any(d in m for d in doing) for m in done_lines), done_lines
