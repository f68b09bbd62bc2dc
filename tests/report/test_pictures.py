"""The pictures: in the trackers (MLflow artifacts, W&B summary images), in a browser, and
honest about NaN, Inf, zero, not-logged and uneven steps."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from gradtrack.report import plots
from gradtrack.report.compare import first_divergence
from gradtrack.report.data import Alert, RunData
from gradtrack.report.render import render_report
from tests.report.conftest import NAN_STEP, ThreeRuns
from tests.report.test_compare import chromium_console
from tests.sinks.wandb_records import read_records, summary

mlflow = pytest.importorskip("mlflow")
matplotlib_image = pytest.importorskip("matplotlib.image")

PICTURES = {"total_norm.png", "flow_profile.png", "heatmap_0.png", "alerts.png", "report.html"}


def pixels(figure: object) -> np.ndarray:
    """The figure drawn as RGB in [0, 1]."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")  # type: ignore[attr-defined]
    buffer.seek(0)
    return matplotlib_image.imread(buffer)[..., :3]


def share_of(image: np.ndarray, hex_color: str, tolerance: float = 0.04) -> float:
    """Fraction of pixels within ``tolerance`` of ``hex_color``."""
    rgb = np.array([int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return float((np.abs(image - rgb).max(axis=-1) < tolerance).mean())


def test_every_mlflow_run_carries_its_pictures(three_runs: ThreeRuns, tmp_path: Path) -> None:
    client = mlflow.MlflowClient(three_runs.uri)
    heatmaps = {}
    for name, run_id in three_runs.ids.items():
        listed = {Path(f.path).name for f in client.list_artifacts(run_id, "gradtrack/pictures")}
        assert PICTURES <= listed, (name, listed)
        assert {"histograms_0.png", "histograms_1.png", "histograms_2.png"} <= listed
        local = client.download_artifacts(run_id, "gradtrack/pictures", str(tmp_path / name))
        heatmaps[name] = matplotlib_image.imread(Path(local) / "heatmap_0.png")[..., :3]
        page = (Path(local) / "report.html").read_text()
        assert page.count("data:image/png;base64,") == len(list(Path(local).glob("*.png")))
    # The NaN run's heatmap shows its NaN layers in red; the healthy runs' have none.
    assert share_of(heatmaps["nan"], plots.NONFINITE_COLOR) > 0.05
    assert share_of(heatmaps["base"], plots.NONFINITE_COLOR) < 0.001  # the legend's patch
    # Histograms are still there as data, beside their pictures.
    assert client.list_artifacts(three_runs.ids["base"], "gradtrack/histograms")


@pytest.mark.slow
def test_every_wandb_run_carries_its_pictures_as_summary_images(three_runs: ThreeRuns) -> None:
    for run_dir in three_runs.dirs.values():
        images = {
            key: value
            for key, value in summary(read_records(run_dir)).items()
            if key.startswith("grad_pictures/")
        }
        assert {"grad_pictures/total_norm", "grad_pictures/heatmap_0"} <= set(images)
        for value in images.values():
            value = json.loads(value) if isinstance(value, str) else value
            assert value["_type"] == "image-file" and value["width"] > 100
            assert (run_dir / "files" / value["path"]).stat().st_size > 5_000


_IMAGE_CHECK = """<script>
window.addEventListener("load", () => {
  const images = [...document.images];
  const loaded = images.filter((i) => i.complete && i.naturalWidth > 0).length;
  console.log(`images loaded ${loaded}/${images.length}`);
});
</script>"""


def images_loaded(html: Path, tmp_path: Path) -> str:
    """What headless Chromium says of the page's images: "images loaded N/M"."""
    probe = tmp_path / f"probe-{html.stem}.html"
    probe.write_text(html.read_text().replace("</body>", _IMAGE_CHECK + "</body>"))
    console = chromium_console(probe, tmp_path / f"{html.stem}.png", tmp_path / "profile")
    found = [line.split("images loaded ")[1].split('"')[0] for line in console.splitlines()
             if "images loaded" in line]  # fmt: skip
    assert len(found) == 1, console
    return found[0]


@pytest.mark.slow
def test_the_report_opens_in_chromium_with_every_image_loaded(
    three_runs: ThreeRuns, tmp_path: Path
) -> None:
    out = tmp_path / "report"
    ids = list(three_runs.ids.values())
    command = [sys.executable, "-m", "gradtrack.cli", "compare", *ids, "--tracking-uri",
               three_runs.uri, "--out", str(out)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    page = (out / "report.html").read_text()
    assert "base and nudged are identical up to step 28, then part at step 30 in layer 2" in page
    assert f"nan: first non-finite gradient at step {NAN_STEP} (first in 0)" in page
    count = page.count("<img ")
    # 3 heatmaps, 3 histograms, 3 more, and the flight recorder's window before nan's NaN
    assert count == len(list(out.glob("*.png"))) == 10
    assert f"nan: every layer&#x27;s norm before the nonfinite at step {NAN_STEP}" in page
    assert images_loaded(out / "report.html", tmp_path) == f"{count}/{count}"
    # The check itself fails on a picture that does not load.
    broken = tmp_path / "broken.html"
    broken.write_text('<body><img src="data:image/png;base64,AAAA"><img src="x.png"></body>')
    assert images_loaded(broken, tmp_path) == "0/2"


def run_of(norms: np.ndarray, steps: list[int], total: np.ndarray | None = None) -> RunData:
    logged = np.ones(norms.shape, dtype=bool)
    return RunData(
        "run", "test", np.array(steps), [f"layer{j}" for j in range(norms.shape[1])],
        {"grad_norm": norms}, norms.sum(axis=1) if total is None else total,
        logged={"grad_norm": logged}, total_logged=np.ones(len(steps), dtype=bool),
    )  # fmt: skip


def test_an_exploded_run_alone_is_drawn_not_an_empty_plot() -> None:
    norms = np.array([[1.0, 2.0], [np.nan, np.nan], [np.nan, np.inf]])
    run = run_of(norms, [0, 10, 20], total=np.array([3.0, np.nan, np.nan]))
    figure = plots.total_norm([run])
    (axes,) = figure.axes
    assert axes.get_xlim()[0] < 0 < 20 < axes.get_xlim()[1]  # not −0.04…0.04
    crosses = [c for c in axes.collections if c.get_label() == "NaN/Inf (top edge)"]
    assert len(crosses) == 1 and crosses[0].get_offsets()[:, 0].tolist() == [10, 20]
    assert share_of(pixels(figure), plots.NONFINITE_COLOR) > 0.0001
    # The one finite point is drawn with a marker, so it is visible on its own.
    (line,) = axes.get_lines()
    assert line.get_marker() == "."


def test_a_report_of_runs_with_no_finite_or_no_nonzero_norm_draws_every_picture(
    tmp_path: Path,
) -> None:
    # Warnings are errors here: no "mean of empty slice", no log axis without positive data.
    for value in (np.nan, 0.0):
        norms = np.full((4, 3), value)
        run = run_of(norms, [0, 10, 20, 30], total=np.full(4, value))
        html = render_report([run], tmp_path / str(value))
        assert len(list(html.parent.glob("*.png"))) == 4
        (axes,) = plots.total_norm([run]).axes
        assert axes.get_ylim() == pytest.approx((0.1, 10))
        assert any("no finite, non-zero" in t.get_text() for t in axes.texts)


def test_heatmap_tells_nan_inf_zero_and_not_logged_apart_at_real_steps() -> None:
    norms = np.array([[1.0, np.nan, 0.5], [2.0, np.inf, 0.0], [1.0, 1.0, 1.0]])
    run = run_of(norms, [0, 100, 110])
    run.logged["grad_norm"][2, 0] = False  # one value not logged
    run.stats["grad_norm"][2, 0] = np.nan
    figure = plots.heatmap(run)
    image = pixels(figure)
    for color in (plots.NONFINITE_COLOR, plots.INF_COLOR, plots.MISSING_COLOR):
        assert share_of(image, color) > 0.005, color
    axes = figure.axes[0]
    mesh = axes.collections[0]
    x_edges = np.unique(mesh.get_coordinates()[..., 0])
    # Columns start at their real steps and last until the next, at most the median gap (55):
    # 55…100 is not logged.
    assert x_edges.tolist() == [0.0, 55.0, 100.0, 110.0, 165.0]
    # zero: white cells inside the plot (the frame's white is outside the axes).
    assert share_of(image, plots.ZERO_COLOR, 0.01) > 0.05
    same = run_of(norms, [0, 100, 110])
    assert share_of(pixels(plots.heatmap(same)), plots.MISSING_COLOR) < share_of(
        image, plots.MISSING_COLOR
    )


def test_alerts_are_labelled_with_their_rule() -> None:
    run = run_of(np.ones((3, 2)), [0, 10, 20])
    run.alerts = [
        Alert(10, "exploding", "warning", "big"),
        Alert(20, "nonfinite", "error", "NaN", origin_layer="layer1"),
    ]
    figure = plots.alert_timeline([run])
    texts = {t.get_text() for t in figure.axes[0].texts}
    assert texts == {"exploding", "nonfinite @ layer1"}


def test_twenty_runs_of_two_hundred_layers_stay_readable() -> None:
    rng = np.random.default_rng(0)
    steps = list(range(0, 200, 10))
    runs = []
    for r in range(20):
        run = run_of(10 ** rng.normal(-2, 1, (len(steps), 200)), steps)
        run.name = f"run-{r:02d}"
        runs.append(run)
    colors = plots.run_colors(20)
    assert len({tuple(c) for c in colors}) == 20  # every run its own colour, none red
    divergences = [None, *(first_divergence(runs[0], run) for run in runs[1:])]
    with tempfile.TemporaryDirectory():
        for figure in (
            plots.total_norm(runs, divergences),
            plots.flow_profile(runs, plots.profile_steps(runs)),
            plots.heatmap(runs[5], plots.log_range(runs), divergences[5], runs[0].name),
        ):
            width, height = figure.get_size_inches() * figure.dpi
            assert width <= 1000 and height <= 1200
            # Tick labels are thinned: at most ~50 layer names on any axis.
            for axes in figure.axes:
                assert len(axes.get_yticklabels()) <= 60
                assert len(axes.get_xticklabels()) <= 60


def pictures_of(client: object, run_id: str) -> set[str]:
    listed = client.list_artifacts(run_id, "gradtrack/pictures")  # type: ignore[attr-defined]
    return {Path(f.path).name for f in listed}


@pytest.mark.slow
def test_pictures_every_n_steps_reach_mlflow_before_close_and_can_be_turned_off(
    mlflow_server: object,
) -> None:
    import torch
    from torch import nn

    import gradtrack

    uri = mlflow_server.uri  # type: ignore[attr-defined]
    client = mlflow.MlflowClient(uri)
    for pictures in (True, False):
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        options = {"tracking_uri": uri, "experiment": "pictures", "pictures": pictures,
                   "pictures_every": 10, "send_every_s": 0}  # fmt: skip
        with gradtrack.watch(model, backend="mlflow", log_every=1, mlflow=options) as watcher:
            for _ in range(12):
                model(torch.randn(8, 4)).sum().backward()
            watcher.flush()  # steps 0…11 delivered: step 10 started a new window of 10
            run_id = watcher.sinks[0].run_id
            assert (PICTURES <= pictures_of(client, run_id)) is pictures
        assert (PICTURES <= pictures_of(client, run_id)) is pictures


def test_the_kept_history_is_bounded_and_keeps_the_first_nonfinite_step() -> None:
    from gradtrack.formats.record import StepRecord
    from gradtrack.report.live import FlowHistory

    history = FlowHistory(max_steps=50, max_layer_steps=20, max_hist_steps=5)
    for step in range(5_000):
        bad = step == 1_234
        stats = np.array([[np.nan if bad else 1.0, 1, 1, 1, 4, 4 if bad else 0, 0]])
        detail = "all" if step % 10 == 0 or bad else "none"
        history.add(StepRecord(step, 0.0, ("fc",), stats, np.nan if bad else 1.0,
                               layer_detail=detail))  # fmt: skip
    assert len(history) <= 100
    run = history.run_data("r", "test")
    assert len(run.per_layer_steps()) <= 40
    found = run.first_nonfinite()
    assert found is not None and found[:2] == (1_234, "fc")
