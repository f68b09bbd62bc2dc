"""The report's findings follow the event's own origin: a NaN the loss made blames no layer,
read back from MLflow's store and from the text a W&B or TensorBoard alert carries."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.report.compare import sentences, summarise, to_json
from gradtrack.report.data import parse_alert_text
from gradtrack.report.sources import read_mlflow_run
from gradtrack.sinks import MemorySink

NAN_AT = 6


def _train_with_a_loss_nan(uri: str, memory: MemorySink, journal: Path) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mlflow = {"tracking_uri": uri, "experiment": "findings", "run_name": "loss-nan"}
    with gradtrack.watch(
        model,
        backend=["mlflow", memory],
        optimizer=optimizer,
        log_every=2,
        mlflow=mlflow,
        alerts={"nonfinite": {"action": "skip"}},  # (the weights stay finite)
        skip={"journal": str(journal)},
    ) as watcher:
        for step in range(12):
            optimizer.zero_grad()
            out = model(torch.randn(16, 8))
            # log(0) at one step: the loss makes the NaN, every layer's gradient receives it
            loss = (out * 0).log().sum() if step == NAN_AT else out.pow(2).mean()
            loss.backward()
            optimizer.step()
    return watcher.sinks[0].run_id  # type: ignore[attr-defined,no-any-return]


@pytest.mark.slow
def test_a_nan_made_by_the_loss_blames_no_layer(tmp_path: Path) -> None:
    memory = MemorySink()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = _train_with_a_loss_nan(uri, memory, tmp_path / "skipped_steps.json")
    (event,) = [e for e in memory.events if e.rule == "nonfinite"]
    assert (event.step, event.origin_stage, event.origin_layer) == (NAN_AT, "loss", None)

    run = read_mlflow_run(run_id, f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert run.first_nonfinite() == (NAN_AT, None, "loss")
    summary = summarise([run])
    said = [s for s in sentences(summary) if "non-finite" in s]
    assert said == [
        f"loss-nan: first non-finite gradient at step {NAN_AT}, made by the loss (no layer "
        "made it)."
    ]
    (found,) = to_json(summary)["runs"]
    assert (found["first_nonfinite"], found["first_nonfinite_layer"]) == (NAN_AT, None)
    assert found["first_nonfinite_stage"] == "loss"

    # The text W&B's and TensorBoard's alerts carry, read back the same way.
    alert = parse_alert_text(f"step {event.step}: {event.message}", "nonfinite", "error")
    assert (alert.step, alert.origin_stage, alert.origin_layer) == (NAN_AT, "loss", None)
