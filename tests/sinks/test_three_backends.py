"""One run logged to MLflow (embedded sqlite), W&B (offline) and TensorBoard at once: every
tracker holds the same keys at the same steps, with the same values, read back with each
tracker's own reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gradtrack.formats.wandb import read_dir
from gradtrack.sinks import MemorySink
from tests.sinks.test_tensorboard import NAN_STEP, STEPS, events, scalars, train

mlflow = pytest.importorskip("mlflow")
wandb = pytest.importorskip("wandb")


def test_one_run_has_the_same_keys_at_the_same_steps_in_all_three(
    offline_wandb: Path, tmp_path: Path
) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    memory = MemorySink()
    watcher = train(
        ["mlflow", "wandb", "tensorboard", memory], log_every=2, layer_every=4,
        histograms={"every": 4},
        mlflow={"tracking_uri": uri, "experiment": "three", "pictures": False},
        wandb={"mode": "offline", "project": "three", "pictures": False},
        tensorboard={"log_dir": str(tmp_path / "tb"), "pictures": False},
        flight={"enabled": False},  # its window reaches MLflow as series only (docs/flight.md)
    )  # fmt: skip
    run_id = watcher.sinks[0].run_id  # type: ignore[attr-defined]
    wandb.teardown()
    expected = memory.scalars()
    steps = [s for s, _ in expected["grad/total_norm"]]
    assert len(expected) > 20 and steps == sorted([*range(0, STEPS, 2), NAN_STEP])  # guarded

    client = mlflow.MlflowClient(uri)
    in_mlflow = {
        key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        for key in client.get_run(run_id).data.metrics
    }
    (run_dir,) = (offline_wandb / "wandb").glob("offline-run-*")
    files = read_dir(run_dir / "files")
    assert files is not None
    in_wandb = {key: v for key, v in files[0].items() if not key.startswith("gradtrack/")}
    acc = events(tmp_path / "tb")
    in_tensorboard = {
        tag: scalars(acc, tag) for tag in acc.Tags()["tensors"] if not tag.endswith("_summary")
    }

    for name, held in (("MLflow", in_mlflow), ("W&B", in_wandb), ("TensorBoard", in_tensorboard)):
        assert set(held) == set(expected), name
        for key, series in expected.items():
            assert [s for s, _ in held[key]] == [s for s, _ in series], (name, key)
            np.testing.assert_array_equal(
                [v for _, v in held[key]], [v for _, v in series], err_msg=f"{name} {key}"
            )
    # The histograms: W&B's step files and TensorBoard's buckets both hold gradtrack's bins.
    for layer, series in memory.histograms().items():
        tensorboard_counts = [
            list(e.histogram_value.bucket) for e in acc.Histograms(f"grad_hist/{layer}")
        ]
        wandb_counts = [h.counts.tolist() for _, h in files[1][f"grad_hist/{layer}"]]
        assert tensorboard_counts == wandb_counts == [h.counts.tolist() for _, h in series]
