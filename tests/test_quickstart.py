"""The README's demo runs as a user would run it, and prints the gradient flow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_trains_and_prints_gradient_flow() -> None:
    demo = ROOT / "examples" / "quickstart.py"
    result = subprocess.run(
        [sys.executable, str(demo), "--steps", "30", "--log-every", "5"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    out = result.stdout
    assert "gradtrack step 0: total gradient norm" in out
    assert "gradtrack step 25: total gradient norm" in out  # the last logged step, at close
    flow = out.split("gradient flow (L2 norm per layer, by depth):")[1].splitlines()
    assert [line.split()[0] for line in flow[2:5]] == ["0", "3", "7"]
