"""The ``gradtrack`` command's options: --version, --layer, --rtol, progress off a terminal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import gradtrack
from gradtrack.cli import main
from tests.report.conftest import ThreeRuns


@pytest.mark.slow
def test_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gradtrack.cli", "--version"], capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout.strip() == f"gradtrack {gradtrack.__version__}"


@pytest.mark.slow
def test_layer_is_repeatable_and_never_swallows_the_runs(
    three_runs: ThreeRuns, tmp_path: Path
) -> None:
    base, nudged = three_runs.ids["base"], three_runs.ids["nudged"]
    # Written as in the issue: a layer option before the runs keeps one value per option.
    args = ["compare", "--layers", "0", "--layer", "6", base, nudged,
            "--tracking-uri", three_runs.uri, "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    pngs = sorted(p.name for p in tmp_path.glob("histograms_*.png"))
    assert pngs == ["histograms_0.png", "histograms_1.png"]  # the two layers asked for
    page = (tmp_path / "report.html").read_text()
    assert "Histogram evolution: 0" in page and "Histogram evolution: 6" in page


def test_an_unknown_layer_is_an_error_naming_close_ones(
    three_runs: ThreeRuns, tmp_path: Path, capsys: Any
) -> None:
    args = ["compare", three_runs.ids["base"], "--layer", "4.weight", "--tracking-uri",
            three_runs.uri, "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 2
    assert "no layer '4.weight' in the runs; closest: 4" in capsys.readouterr().err
    assert not (tmp_path / "report.html").exists()  # no half-drawn report


def test_a_negative_tolerance_is_refused(capsys: Any) -> None:
    assert main(["compare", "x", "--rtol", "-1"]) == 2
    assert "--rtol must be >= 0" in capsys.readouterr().err


def test_progress_off_a_terminal_is_one_line_every_few_seconds(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from gradtrack import cli

    clock = [100.0]
    monkeypatch.setattr(cli, "_clock", lambda: clock[0])
    cli._progress_clock.update(start=100.0, last=0.0)
    for done in range(1, 40):
        clock[0] += 0.5  # a read of 39 metrics, 0.5 s each
        cli._progress("reading run", done, 40)
    lines = capsys.readouterr().err.splitlines()
    # Nothing in the first 5 s, then one line per 5 s: never a bar redrawn into a log.
    assert lines == ["gradtrack: reading run: 10/40", "gradtrack: reading run: 20/40",
                     "gradtrack: reading run: 30/40"]  # fmt: skip
