"""No credential from gradtrack's config reaches a W&B run: real SDK, offline, raw bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.config import GradtrackConfig, redacted_config
from tests.sinks.wandb_records import of_type, read_records, run_dirs

wandb = pytest.importorskip("wandb")

PASSWORD = "hunter2-Secret-9f3a"


def test_redacted_config_drops_userinfo_and_secret_named_fields() -> None:
    config = GradtrackConfig(mlflow={"tracking_uri": f"https://bob:{PASSWORD}@mlflow.example/"})
    data = redacted_config(config)
    assert data["mlflow"]["tracking_uri"] == "https://***@mlflow.example/"
    assert data["log_every"] == config.log_every  # the rest is left as it was
    nested = {
        "store": {"uri": f"postgresql://u:{PASSWORD}@db:5432/x", "api_key": PASSWORD},
        "Auth_Token": PASSWORD, "client_secret": PASSWORD, "db_password": PASSWORD,
        "paths": ["file:///tmp/a@b", f"s3://k:{PASSWORD}@bucket/x"],
        "query": f"https://host/api?user=bob&access_token={PASSWORD}",
    }  # fmt: skip
    assert redacted_config(nested) == {
        "store": {"uri": "postgresql://***@db:5432/x"},
        "paths": ["file:///tmp/a@b", "s3://***@bucket/x"],
        "query": "https://host/api?user=bob&access_token=***",
    }


@pytest.mark.slow
def test_a_password_in_the_mlflow_uri_reaches_no_file_of_the_run(
    offline_wandb: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    model = nn.Linear(3, 1)
    with gradtrack.watch(
        model, backend="wandb", log_every=1,
        wandb={"mode": "offline", "dir": str(offline_wandb), "project": "gradtrack-tests"},
        mlflow={"tracking_uri": f"http://alice:{PASSWORD}@mlflow.example:5000"},
    ):  # fmt: skip
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
    wandb.teardown()

    (run_dir,) = run_dirs(offline_wandb)
    (run,) = of_type(read_records(run_dir), "run")
    written = run["config"]["update"]["gradtrack"]["mlflow"]["tracking_uri"]
    assert written == "http://***@mlflow.example:5000"  # the config was written, redacted
    files = [path for path in offline_wandb.rglob("*") if path.is_file()]
    assert any(path.suffix == ".wandb" for path in files)
    leaked = [path for path in files if PASSWORD.encode() in path.read_bytes()]
    assert leaked == []
    out, err = capfd.readouterr()
    assert PASSWORD not in out + err
