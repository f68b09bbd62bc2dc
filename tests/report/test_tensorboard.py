"""`gradtrack report` / `compare` on TensorBoard log dirs: a TensorBoard run reads back as the
same run logged to MLflow at once, and compares against MLflow runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.cli import read_run
from gradtrack.report.compare import rank_layers
from tests.report.test_compare import deep_mlp

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")
pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A healthy (ReLU) and a vanishing (sigmoid) MLP, each logged to TensorBoard and to
    MLflow (embedded sqlite) at once; the vanishing one hits a NaN at step 24."""
    root = tmp_path_factory.mktemp("tensorboard-runs")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    dirs = {}
    for name, activation in (("healthy", nn.ReLU), ("vanishing", nn.Sigmoid)):
        model = deep_mlp(activation)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(1)
        with gradtrack.watch(
            model, backend=["tensorboard", "mlflow"], optimizer=optimizer, log_every=2,
            histograms={"every": 10}, layer_every=10, alerts={"nonfinite": {"action": "skip"}},
            skip={"journal": str(root / f"{name}-skipped.json")},
            tensorboard={"log_dir": str(root / name)},
            mlflow={"tracking_uri": uri, "experiment": "tb", "run_name": name, "pictures": False},
            flight={"enabled": False},  # its window reaches MLflow as series, not TensorBoard
        ):  # fmt: skip
            for step in range(40):
                optimizer.zero_grad()
                model(torch.randn(32, 16, generator=generator)).pow(2).mean().backward()
                if name == "vanishing" and step == 24:
                    model[4].weight.grad[0, 0] = float("nan")
                optimizer.step()
        dirs[name] = root / name
    return {"uri": uri, "dirs": dirs}


@pytest.mark.parametrize("name", ["healthy", "vanishing"])
@pytest.mark.slow
def test_a_tensorboard_run_reads_back_as_the_same_run_in_mlflow(
    both: dict[str, Any], name: str
) -> None:
    from_tb = read_run(str(both["dirs"][name]), None)
    from_mlflow = read_run(f"tb/{name}", both["uri"])
    assert from_tb.source.startswith("TensorBoard log dir ")
    assert from_tb.layers == from_mlflow.layers == [str(i) for i in range(0, 17, 2)]
    np.testing.assert_array_equal(from_tb.steps, from_mlflow.steps)
    np.testing.assert_array_equal(from_tb.per_layer_steps(), from_mlflow.per_layer_steps())
    for family, table in from_mlflow.stats.items():
        np.testing.assert_array_equal(from_tb.stats[family], table, err_msg=family)
    np.testing.assert_array_equal(from_tb.total_norm, from_mlflow.total_norm)
    assert sorted(from_tb.histograms) == sorted(from_mlflow.histograms)
    for layer, series in from_mlflow.histograms.items():
        assert [s for s, _ in from_tb.histograms[layer]] == [s for s, _ in series]
        for (_, a), (_, b) in zip(from_tb.histograms[layer], series):
            np.testing.assert_array_equal(a.counts, b.counts)
            np.testing.assert_array_equal(a.edges, b.edges)
    key = [(a.step, a.rule, a.severity, a.origin_layer) for a in from_mlflow.alerts]
    assert [(a.step, a.rule, a.severity, a.origin_layer) for a in from_tb.alerts] == key
    if name == "vanishing":
        found = from_mlflow.first_nonfinite()
        assert from_tb.first_nonfinite() == found and found is not None and found[:2] == (24, "4")


@pytest.mark.slow
def test_compare_a_tensorboard_run_with_an_mlflow_run(both: dict[str, Any], tmp_path: Path) -> None:
    healthy_tb, vanishing_mlflow = str(both["dirs"]["healthy"]), "tb/vanishing"
    ranked_mixed = rank_layers(
        [read_run(healthy_tb, None), read_run(vanishing_mlflow, both["uri"])]
    )
    ranked_mlflow = rank_layers(
        [read_run("tb/healthy", both["uri"]), read_run(vanishing_mlflow, both["uri"])]
    )
    assert [d.layer for d in ranked_mixed] == [d.layer for d in ranked_mlflow]
    assert [d.layer for d in ranked_mixed[:3]] == ["0", "2", "4"]

    def compare(*runs: str, parity: bool = False) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "gradtrack.cli", "compare", *runs, "--json",
                   "--tracking-uri", both["uri"], "--out", str(tmp_path / "out"),
                   *(["--parity"] if parity else [])]  # fmt: skip
        return subprocess.run(command, capture_output=True, text=True, timeout=300)

    parted = compare(healthy_tb, vanishing_mlflow, parity=True)
    assert parted.returncode == 1, parted.stderr  # they part
    summary = json.loads(parted.stdout)
    assert [run["source"].split(" ")[0] for run in summary["runs"]] == ["TensorBoard", "MLflow"]
    # The same run in both trackers: --parity compares exactly, and finds them identical.
    same = compare(f"tensorboard:{healthy_tb}", "tb/healthy", parity=True)
    assert same.returncode == 0, same.stdout + same.stderr


@pytest.mark.slow
def test_report_of_a_tensorboard_run(both: dict[str, Any], tmp_path: Path) -> None:
    from gradtrack.cli import main

    assert main(["report", str(both["dirs"]["vanishing"]), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "report.html").exists() and (tmp_path / "heatmap_0.png").exists()


def test_a_folder_without_event_files_is_not_read_as_tensorboard(tmp_path: Path) -> None:
    from gradtrack.errors import GradtrackError
    from gradtrack.report.sources import read_tensorboard_dir

    with pytest.raises(GradtrackError, match="is not a TensorBoard log dir"):
        read_tensorboard_dir(tmp_path)
