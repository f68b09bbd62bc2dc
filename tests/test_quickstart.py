"""The README's demo runs as a user would run it, and prints the gradient flow."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_trains_and_prints_gradient_flow(tmp_path: Path) -> None:
    demo = ROOT / "examples" / "quickstart.py"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    result = subprocess.run(
        [sys.executable, str(demo), "--steps", "30", "--log-every", "5"],
        capture_output=True, text=True, timeout=300, check=True, cwd=tmp_path, env=env,
    )  # fmt: skip
    out = result.stdout
    assert "gradtrack step 0: total gradient norm" in out
    assert "gradtrack step 25: total gradient norm" in out  # the last logged step, at close
    flow = out.split("gradient flow (L2 norm per layer, by depth):")[1].splitlines()
    assert [line.split()[0] for line in flow[2:5]] == ["0", "3", "7"]
    # The embedded default backend: MLflow's sqlite store in the working directory.
    assert "mlflow ui --backend-store-uri sqlite:///" in out
    assert (tmp_path / "mlflow.db").exists()
    report = next(line.split() for line in out.splitlines() if "gradtrack report" in line)
    assert Path(report[0]).name == "gradtrack"  # a command that exists where the demo ran
    command = [sys.executable, "-m", "gradtrack.cli", *report[1:]]
    rendered = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert rendered.returncode == 0, rendered.stderr
    assert (tmp_path / "gradtrack-report" / "report.html").exists()
