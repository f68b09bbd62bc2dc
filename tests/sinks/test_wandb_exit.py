"""A script that exits without close() (nor finish()) still delivers every step to W&B, and
gradtrack's exit path runs before every atexit hook (W&B's teardown among them)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from gradtrack.report.sources import read_wandb_offline
from tests.sinks.wandb_records import history, of_type, read_records, run_dirs, run_python

pytest.importorskip("wandb")

EXIT_BOUND_S = 120  # the whole script, W&B's start and shutdown included

MODEL = "torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))"

SCRIPTS = {
    # gradtrack starts the run and nobody closes anything
    "gradtrack's run": """
        import torch, gradtrack
        model = {model}
        gradtrack.watch(model, backend="wandb", wandb={{"name": "never-closed"}})
        for step in range({steps}):
            model.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
    """,
    # the user's run, never finished; the user logs every step with step=
    "the user's run": """
        import torch, wandb, gradtrack
        run = wandb.init(name="never-finished")
        model = {model}
        gradtrack.watch(model, backend="wandb")
        for step in range({steps}):
            model.zero_grad()
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            run.log({{"loss": loss.item()}}, step=step)
    """,
    # watch before wandb.init: W&B's exit hooks are registered after gradtrack's
    "the user's run started after watch": """
        import torch, wandb, gradtrack
        model = {model}
        gradtrack.watch(model, backend="wandb")
        run = wandb.init(name="started-late")
        for step in range({steps}):
            model.zero_grad()
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            run.log({{"loss": loss.item()}})
    """,
}


def run_script(offline: Path, name: str, steps: int) -> None:
    code = textwrap.dedent(SCRIPTS[name]).format(model=MODEL, steps=steps)
    result = run_python(code, offline, EXIT_BOUND_S)
    assert result.returncode == 0, result.stderr
    assert "Error" not in result.stderr, result.stderr  # e.g. MailboxClosedError, warnings


@pytest.mark.parametrize("name", list(SCRIPTS))
@pytest.mark.parametrize("steps", [300, 25])
@pytest.mark.slow
def test_exit_without_close_delivers_every_step_at_the_defaults(
    offline_wandb: Path, name: str, steps: int
) -> None:
    run_script(offline_wandb, name, steps)
    (run_dir,) = run_dirs(offline_wandb)
    records = read_records(run_dir)
    rows = history(records)
    assert read_wandb_offline(run_dir).steps.tolist() == list(range(0, steps, 10))  # log_every=10
    ours = [row["gradtrack/step"] for row in rows if "gradtrack/step" in row]
    assert ours and ours == sorted(set(ours))
    if name == "gradtrack's run":
        assert ours == list(range(0, steps, 10))  # alone in its run: a row per step
    else:
        user = [row["_step"] for row in rows if "loss" in row]
        assert user == list(range(steps))  # the user's rows, untouched
        # The newest step rides the row open at the end, or a step with more keys held it
        # (histograms and per-layer statistics every 100 steps at the defaults).
        assert ours[-1] >= steps - 10 - 100
    assert [e.get("exit_code", 0) for e in of_type(records, "exit")] == [0]


@pytest.mark.slow
def test_open_watchers_are_closed_before_any_atexit_hook(tmp_path: Path) -> None:
    """An atexit hook registered after watch() (as W&B registers its service's teardown when
    a run starts) runs after the watcher was closed and its sink had every step."""
    code = textwrap.dedent(
        """
        import atexit, torch, gradtrack
        from gradtrack.sinks import MemorySink
        memory = MemorySink()
        model = torch.nn.Linear(3, 1)
        gradtrack.watch(model, backend=[memory], log_every=1)
        atexit.register(lambda: print("at exit:", memory.closed, len(memory.records)))
        for _ in range(7):
            model(torch.randn(2, 3)).sum().backward()
        """
    )
    result = run_python(code, tmp_path, EXIT_BOUND_S)
    assert result.returncode == 0, result.stderr
    assert "at exit: True 7" in result.stdout, result.stdout + result.stderr
