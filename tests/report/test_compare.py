"""`gradtrack compare`: two real runs — healthy and vanishing — read back from MLflow and W&B."""

from __future__ import annotations

import os
import re
import shutil
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
from gradtrack.errors import GradtrackError
from gradtrack.report.compare import rank_layers
from tests.sinks.mlflow_server import MlflowServer

mlflow = pytest.importorskip("mlflow")
wandb = pytest.importorskip("wandb")
pytest.importorskip("matplotlib")


def deep_mlp(activation: type[nn.Module]) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (nn.Linear(16, 16), activation())]
    return nn.Sequential(*layers, nn.Linear(16, 1))


@pytest.fixture(scope="module")
def two_runs(
    mlflow_server: MlflowServer, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The same MLP with ReLU (healthy) and with sigmoid (vanishing), logged to both trackers."""
    root = tmp_path_factory.mktemp("runs")
    os.environ["WANDB_SILENT"] = "true"
    ids, dirs = {}, {}
    for name, activation in (("healthy", nn.ReLU), ("vanishing", nn.Sigmoid)):
        model = deep_mlp(activation)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(1)
        with gradtrack.watch(
            model, backend=["wandb", "mlflow"], optimizer=optimizer, log_every=2,
            histograms={"every": 10}, layer_every=10,
            wandb={"mode": "offline", "name": name, "dir": str(root / name)},
            mlflow={"tracking_uri": mlflow_server.uri, "experiment": "compare", "run_name": name},
        ) as watcher:  # fmt: skip
            for _ in range(40):
                optimizer.zero_grad()
                model(torch.randn(32, 16, generator=generator)).pow(2).mean().backward()
                optimizer.step()
        ids[name] = watcher.sinks[1].run_id
        (dirs[name],) = (root / name / "wandb").glob("offline-run-*")
    wandb.teardown()
    return {"uri": mlflow_server.uri, "ids": ids, "dirs": dirs, "root": root}


@pytest.mark.slow
def test_both_sources_rank_the_vanishing_layers_first_and_agree(two_runs: dict[str, Any]) -> None:
    uri = two_runs["uri"]
    from_mlflow = [read_run(f"compare/{name}", uri) for name in ("healthy", "vanishing")]
    from_wandb = [read_run(str(two_runs["dirs"][name]), None) for name in ("healthy", "vanishing")]
    assert [r.name for r in from_wandb] == ["healthy", "vanishing"]
    ranked_mlflow, ranked_wandb = rank_layers(from_mlflow), rank_layers(from_wandb)
    # The sigmoid net starves its first layers most: they differ most from the healthy run.
    assert [d.layer for d in ranked_mlflow[:3]] == ["0", "2", "4"]
    assert ranked_mlflow[0].spread > 3  # decades
    assert [d.layer for d in ranked_wandb] == [d.layer for d in ranked_mlflow]
    for a, b in zip(ranked_wandb, ranked_mlflow):
        assert a.spread == pytest.approx(b.spread, rel=1e-9)
    for run_m, run_w in zip(from_mlflow, from_wandb):
        assert run_m.layers == run_w.layers == [str(i) for i in range(0, 17, 2)]
        np.testing.assert_array_equal(run_m.steps, run_w.steps)
        # Totals at every logged step; per-layer statistics every layer_every steps, and at
        # the first step of each such window that raised an alert.
        assert run_m.steps.tolist() == list(range(0, 40, 2))
        per_layer = run_m.per_layer_steps().tolist()
        assert per_layer == run_w.per_layer_steps().tolist()
        first_alerts = {
            min(a.step for a in run_m.alerts if a.step // 10 == window)
            for window in {a.step // 10 for a in run_m.alerts}
        }
        assert set(per_layer) == {0, 10, 20, 30} | first_alerts
        np.testing.assert_allclose(run_m.norms, run_w.norms, rtol=1e-12)
        assert sorted(run_m.histograms) == sorted(run_w.histograms)
        for layer, series in run_m.histograms.items():
            other = dict(run_w.histograms[layer])
            for step, histogram in series:
                np.testing.assert_array_equal(histogram.counts, other[step].counts)


def chromium_console(html: Path, screenshot: Path, profile: Path) -> str:
    """Open ``html`` in headless Chromium; return what its console said."""
    browser = shutil.which("chromium")
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's chromium (.ci/run does)")
        pytest.skip("chromium is not installed here (.ci/run installs it)")
    result = subprocess.run(
        [
            browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
            "--window-size=1200,2400", f"--screenshot={screenshot}", html.as_uri(),
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert screenshot.exists(), result.stderr[-2000:]
    return "\n".join(line for line in result.stderr.splitlines() if ":CONSOLE" in line)


@pytest.mark.slow
def test_report_html_opens_cleanly_and_its_pngs_have_content(
    two_runs: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "report"
    runs = ["compare/healthy", "compare/vanishing"]
    command = [sys.executable, "-m", "gradtrack.cli", "compare", *runs,
               "--tracking-uri", two_runs["uri"], "--out", str(out)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    *findings, last = result.stdout.strip().splitlines()
    html = Path(last.removeprefix("report: "))
    assert html == out / "report.html"
    # The findings, on the terminal as in the report (one per line, after their count).
    count = len(findings) - 1
    assert findings[0] == f"{count} finding{'s' if count > 1 else ''}:"
    said = [line.strip() for line in findings[1:]]
    assert said and all(line in text_of(html) for line in said)
    assert any("part" in line or "diverge" in line for line in said), said
    text = html.read_text()
    sources = re.findall(r'(?:src|href)="([^"]*)"', text)  # self-contained: nothing to fetch
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources)
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == [
        "alerts.png", "flow_profile.png", "heatmap_0.png", "heatmap_1.png",
        "histograms_0.png", "histograms_1.png", "histograms_2.png", "total_norm.png",
    ]  # fmt: skip
    import matplotlib.image

    for png in out.glob("*.png"):
        pixels = matplotlib.image.imread(png)[..., :3]
        assert pixels.std() > 0.05 and (pixels < 0.5).mean() > 0.005, png.name  # not blank

    console = chromium_console(html, tmp_path / "report.png", tmp_path / "profile")
    assert console == "" and (tmp_path / "report.png").stat().st_size > 50_000
    # The console check itself can fail: a page that logs an error is caught.
    broken = tmp_path / "broken.html"
    broken.write_text('<script>console.error("report-broken")</script>')
    assert "report-broken" in chromium_console(broken, tmp_path / "b.png", tmp_path / "p2")


@pytest.mark.slow
def test_report_of_one_run(two_runs: dict[str, Any], tmp_path: Path) -> None:
    from gradtrack.cli import main

    run_id = two_runs["ids"]["vanishing"]
    assert main(["report", run_id, "--tracking-uri", two_runs["uri"], "--out", str(tmp_path)]) == 0
    assert (tmp_path / "report.html").exists() and (tmp_path / "heatmap_0.png").exists()


def test_bad_runs_get_clear_errors(two_runs: dict[str, Any], tmp_path: Path, capsys: Any) -> None:
    from gradtrack.cli import main

    uri = two_runs["uri"]
    assert main(["report", "0123456789abcdef0123456789abcdef", "--tracking-uri", uri]) == 2
    assert "no MLflow run '0123456789abcdef0123456789abcdef'" in capsys.readouterr().err
    assert main(["report", "compare/nope", "--tracking-uri", uri]) == 2
    assert "no run named 'nope' in experiment 'compare'" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("not a run")
    assert main(["report", str(tmp_path)]) == 2
    assert "is not a W&B run directory" in capsys.readouterr().err

    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("compare").experiment_id
    run = client.create_run(experiment, run_name="no-gradients")
    client.log_metric(run.info.run_id, "loss", 1.0)
    client.set_terminated(run.info.run_id)
    with pytest.raises(
        GradtrackError, match=r"holds no gradtrack data .* found instead: \['loss'\]"
    ):
        read_run(run.info.run_id, uri)


def text_of(html: Path) -> str:
    """The report's words, without its markup (a finding is one paragraph or list item)."""
    import html as markup

    return markup.unescape(re.sub(r"<[^>]+>", "", html.read_text()))
