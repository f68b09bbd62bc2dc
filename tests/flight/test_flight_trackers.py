"""The flight recorder end to end, with the defaults: a NaN made at an unlogged step after
~500 steps, one layer's gradient growing for 29 steps before it. MLflow (a real SQLite
store) and W&B (an offline run, read back from its files) hold every layer's norm at each of
the 256 steps before it, equal to norms taken from ``p.grad``; the NaN's event names the
growing layer and the step its growth began."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.formats.flight import read_windows_dir
from gradtrack.sinks import MemorySink
from tests.sinks.wandb_records import run_dirs

mlflow = pytest.importorskip("mlflow")
wandb = pytest.importorskip("wandb")

NAN_AT = 517  # not a multiple of log_every=10: an unlogged step
GROWS_FROM = 488
K = 256


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(x.flatten(1))


def layer_norms(model: Net) -> dict[str, float]:
    return {
        name: math.sqrt(sum(float(p.grad.double().norm()) ** 2 for p in module.parameters()))
        for name, module in (("conv1", model.conv1), ("conv2", model.conv2), ("fc", model.fc))
    }


def train(model: Net, watcher: gradtrack.Watcher, optimizer: torch.optim.Optimizer) -> dict:
    """530 steps; conv2's gradient grows ×1.2 per step from GROWS_FROM; NaN at NAN_AT."""
    model.conv2.weight.register_hook(
        lambda g: g * 1.2 ** (watcher.step - GROWS_FROM + 1) if watcher.step >= GROWS_FROM else g
    )
    generator = torch.Generator().manual_seed(0)
    reference = {}
    for step in range(NAN_AT + 3):
        images = torch.randn(16, 3, 8, 8, generator=generator)
        labels = torch.randint(4, (16,), generator=generator)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(images), labels)
        (loss * float("nan") if step == NAN_AT else loss).backward()
        reference[step] = layer_norms(model)
        optimizer.step()
    return reference


@pytest.mark.slow
def test_a_nan_at_an_unlogged_step_leaves_the_256_steps_before_it_in_mlflow_and_wandb(
    tmp_path: Path, offline_wandb: Path, one_thread: None
) -> None:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    memory = MemorySink()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with gradtrack.watch(
        model, backend=["mlflow", "wandb", memory], optimizer=optimizer,
        mlflow={"tracking_uri": uri, "experiment": "flight"},
    ) as watcher:  # fmt: skip
        reference = train(model, watcher, optimizer)
        run_id = watcher.sinks[0].run_id  # type: ignore[attr-defined]
    assert wandb.run is None  # gradtrack started the run and finished it at close
    before = range(NAN_AT - K, NAN_AT)

    # The NaN's event names the first mover, and the step it began.
    (nan_event,) = [e for e in memory.events if e.rule == "nonfinite" and e.step == NAN_AT]
    assert nan_event.first_mover == "conv2"
    assert nan_event.first_mover_step is not None
    assert GROWS_FROM - 1 <= nan_event.first_mover_step <= GROWS_FROM + 2
    gap = NAN_AT - nan_event.first_mover_step
    assert (
        f"conv2's gradient norm began rising at step {nan_event.first_mover_step}, {gap} "
        f"steps before the non-finite gradient at step {NAN_AT}" in nan_event.message
    )

    # MLflow: every layer's norm at each of the K steps before the NaN, as series.
    client = mlflow.MlflowClient(uri)
    for layer in ("conv1", "conv2", "fc"):
        history = {m.step: m.value for m in client.get_metric_history(run_id, f"grad_norm/{layer}")}
        assert set(before) <= set(history), sorted(set(before) - set(history))[:5]
        for step in before:
            assert history[step] == pytest.approx(reference[step][layer], rel=1e-5), (layer, step)
        assert math.isnan(history[NAN_AT])
        steps = sorted(history)
        assert len(steps) == len(set(steps))  # each step once (logged steps not sent twice)
    artifacts = [a.path for a in client.list_artifacts(run_id, "gradtrack/flight")]
    assert f"gradtrack/flight/window-{NAN_AT:09d}.json" in artifacts
    assert f"gradtrack/flight/window-{NAN_AT:09d}.png" in artifacts

    # W&B: the window's file among the run's files, read back with gradtrack's reader.
    (run_dir,) = run_dirs(offline_wandb)
    windows = {w.incident_step: w for w in read_windows_dir(run_dir / "files")}
    window = windows[NAN_AT]
    assert window.incident == "nonfinite" and window.first_mover == "conv2"
    assert window.steps.tolist() == list(range(NAN_AT - K, NAN_AT + 1))
    for row, step in zip(window.norms, window.steps.tolist()):
        if step < NAN_AT:
            expected = [reference[step][layer] for layer in window.layers]
            np.testing.assert_allclose(row, expected, rtol=1e-5)
    assert np.isnan(window.norms[-1]).all()
    assert (run_dir / "files" / "gradtrack" / "flight" / f"window-{NAN_AT:09d}.png").exists()

    # The report reads the windows back from both trackers, and for this one run says what
    # it found: the incidents and their first mover, the first NaN, the weakest layer.
    from gradtrack.report.compare import sentences, summarise, to_json
    from gradtrack.report.render import render_report
    from gradtrack.report.sources import read_mlflow_run, read_wandb_offline

    for run in (read_mlflow_run(run_id, uri), read_wandb_offline(run_dir)):
        assert NAN_AT in [w.incident_step for w in run.windows]
        summary = summarise([run])
        found = sentences(summary)
        assert any(f"nonfinite at step {NAN_AT}" in line and "conv2's gradient norm began" in line
                   for line in found), found  # fmt: skip
        assert any(f"first non-finite gradient at step {NAN_AT}" in line for line in found)
        assert any("the weakest layer is" in line and "below the strongest" in line
                   for line in found), found  # fmt: skip
        assert NAN_AT in [w["incident_step"] for w in to_json(summary)["runs"][0]["flight_windows"]]
    page = render_report([run], tmp_path / "report").read_text()
    assert "conv2&#x27;s gradient norm began rising" in page
    assert f"before the nonfinite at step {NAN_AT} (flight recorder)" in page
    assert "first differs at step" not in page  # one run: no empty difference columns


@pytest.mark.parametrize(("bound", "as_series"), [(99, True), (98, False)])
@pytest.mark.slow
def test_a_window_past_the_series_bound_goes_to_mlflow_as_its_artifact_only(
    tmp_path: Path, bound: int, as_series: bool
) -> None:
    """32 steps before the NaN and the NaN's: 33 × 3 layers = 99 values."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    flight = {"steps": 32, "series_max_values": bound}
    with gradtrack.watch(model, backend="mlflow", optimizer=optimizer, flight=flight,
                         mlflow={"tracking_uri": uri}) as watcher:  # fmt: skip
        generator = torch.Generator().manual_seed(0)
        for step in range(50):
            optimizer.zero_grad()
            loss = model(torch.randn(4, 3, 8, 8, generator=generator)).pow(2).mean()
            (loss * float("nan") if step == 45 else loss).backward()
            optimizer.step()
    run_id = watcher.sinks[0].run_id  # type: ignore[attr-defined]  # (opened by delivery)
    client = mlflow.MlflowClient(uri)
    steps = {m.step for m in client.get_metric_history(run_id, "grad_norm/conv2")}
    assert (set(range(13, 46)) <= steps) is as_series
    assert steps >= {0, 45}  # the per-layer steps logged anyway
    artifacts = [a.path for a in client.list_artifacts(run_id, "gradtrack/flight")]
    assert "gradtrack/flight/window-000000045.json" in artifacts
