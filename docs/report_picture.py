"""Draws docs/report.png, the README's picture of a report: three runs of one MLP (a base run,
the same run with layer 2's gradient nudged ×1.5 at step 30, and with a NaN at step 20); prints
their `gradtrack compare --json` summary.

    python docs/report_picture.py      # needs mlflow, matplotlib and Debian's chromium
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import nn

import gradtrack
from gradtrack.cli import main


def train(name: str, uri: str) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
        nn.Linear(32, 1),
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    with gradtrack.watch(
        model, backend="mlflow", optimizer=optimizer, log_every=2, layer_every=2,
        histograms={"every": 4},
        mlflow={"tracking_uri": uri, "experiment": "readme", "run_name": name, "pictures": False},
    ) as watcher:  # fmt: skip
        for step in range(80):
            optimizer.zero_grad()
            model(torch.randn(32, 16, generator=generator)).pow(2).mean().backward()
            if name == "nudged" and step == 30:
                for parameter in model[2].parameters():
                    parameter.grad.mul_(1.5)
            if name == "nan" and step == 20:
                model[0].weight.grad[0, 0] = float("nan")
            optimizer.step()
    return str(watcher.sinks[0].run_id)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as directory:
        uri = f"sqlite:///{directory}/mlflow.db"
        ids = [train(name, uri) for name in ("base", "nudged", "nan")]
        out = Path(directory) / "report"
        main(["compare", *ids, "--tracking-uri", uri, "--out", str(out), "--json"])
        shot = Path(directory) / "report.png"
        subprocess.run(
            [shutil.which("chromium") or "chromium", "--headless", "--no-sandbox",
             "--disable-gpu", "--hide-scrollbars", "--window-size=1150,1500",
             f"--screenshot={shot}", (out / "report.html").as_uri()],
            check=True, capture_output=True,
        )  # fmt: skip
        target = Path(__file__).parent / "report.png"
        shutil.copy(shot, target)
        print(target, target.stat().st_size)
