"""Three real runs for the comparison tests: a base run, the same run with one layer's
gradient nudged at step 30, and the same run with a NaN at step 20 — logged to a real MLflow
server and to W&B offline runs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

import gradtrack
from tests.sinks.mlflow_server import MlflowServer

NUDGE_STEP, NUDGED_LAYER = 30, "2"
NAN_STEP, NAN_LAYER = 20, "0"
STEPS = 40


@dataclass
class ThreeRuns:
    uri: str
    ids: dict[str, str]  # base, nudged, nan → MLflow run id
    dirs: dict[str, Path]  # → W&B offline run directory


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
        nn.Linear(32, 1),
    )  # fmt: skip


def train(name: str, root: Path, uri: str) -> tuple[str, Path]:
    """40 SGD steps, identical in every run but for the one change ``name`` asks for."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    with gradtrack.watch(
        model, backend=["wandb", "mlflow"], optimizer=optimizer, log_every=2, layer_every=10,
        histograms={"every": 10}, wandb={"mode": "offline", "name": name, "dir": str(root / name)},
        mlflow={"tracking_uri": uri, "experiment": "divergence", "run_name": name},
    ) as watcher:  # fmt: skip
        for step in range(STEPS):
            optimizer.zero_grad()
            model(torch.randn(32, 16, generator=generator)).pow(2).mean().backward()
            if name == "nudged" and step == NUDGE_STEP:  # every statistic of the layer × 1.5
                for parameter in model[int(NUDGED_LAYER)].parameters():
                    parameter.grad.mul_(1.5)
            if name == "nan" and step == NAN_STEP:
                model[int(NAN_LAYER)].weight.grad[0, 0] = float("nan")
            optimizer.step()
    (run_dir,) = (root / name / "wandb").glob("offline-run-*")
    return watcher.sinks[1].run_id, run_dir


@pytest.fixture(scope="session")
def three_runs(mlflow_server: MlflowServer, tmp_path_factory: pytest.TempPathFactory) -> ThreeRuns:
    wandb = pytest.importorskip("wandb")
    pytest.importorskip("matplotlib")
    root = tmp_path_factory.mktemp("three-runs")
    os.environ["WANDB_SILENT"] = "true"
    ids, dirs = {}, {}
    for name in ("base", "nudged", "nan"):
        ids[name], dirs[name] = train(name, root, mlflow_server.uri)
    wandb.teardown()
    return ThreeRuns(mlflow_server.uri, ids, dirs)
