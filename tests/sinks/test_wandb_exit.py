"""A script that exits without close() (nor finish()) still delivers every step to W&B."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.sinks.wandb_records import history, of_type, read_records, run_dirs

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
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=offline, timeout=EXIT_BOUND_S,
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Error" not in result.stderr, result.stderr  # e.g. MailboxClosedError, warnings


@pytest.mark.parametrize("name", list(SCRIPTS))
@pytest.mark.parametrize("steps", [300, 25])
def test_exit_without_close_delivers_every_step_at_the_defaults(
    offline_wandb: Path, name: str, steps: int
) -> None:
    run_script(offline_wandb, name, steps)
    (run_dir,) = run_dirs(offline_wandb)
    records = read_records(run_dir)
    rows = history(records)
    ours = [row["gradtrack/step"] for row in rows if "gradtrack/step" in row]
    assert ours == list(range(0, steps, 10))  # log_every=10, the default
    if name != "gradtrack's run":
        user = [row["_step"] for row in rows if "loss" in row]
        assert user == list(range(steps))  # the user's rows, untouched
    assert [e.get("exit_code", 0) for e in of_type(records, "exit")] == [0]
