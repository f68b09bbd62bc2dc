"""No credential from gradtrack's config reaches a W&B run: real SDK, offline, raw bytes.
Secrets are told by their type (``SecretStr``), so no option is lost for its name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import SecretStr
from torch import nn

import gradtrack
from gradtrack.config import GradtrackConfig, load_config, redacted_config
from tests.sinks.wandb_records import of_type, read_records, run_dirs

wandb = pytest.importorskip("wandb")

PASSWORD = "hunter2-Secret-9f3a"
MASK = "**********"  # pydantic's, ten stars whatever the secret's length


def test_the_tracking_uri_is_a_secret_wherever_the_config_is_shown() -> None:
    uri = f"https://bob:{PASSWORD}@mlflow.example/"
    for config in (
        GradtrackConfig(mlflow={"tracking_uri": uri}),
        load_config(environ={"GRADTRACK_MLFLOW__TRACKING_URI": uri}),
    ):
        assert isinstance(config.mlflow.tracking_uri, SecretStr)
        assert config.mlflow.tracking_uri.get_secret_value() == uri
        assert PASSWORD not in repr(config) + str(config) + config.model_dump_json()
        # A secret URI keeps its server, its login masked; any other secret is stars.
        assert redacted_config(config)["mlflow"]["tracking_uri"] == "https://***@mlflow.example/"


def test_redacted_config_masks_secrets_by_type_and_logins_in_strings() -> None:
    config = GradtrackConfig(layer_keys="depth", mlflow={"experiment": "e"})
    data = redacted_config(config)
    assert data["layer_keys"] == "depth"  # named like a secret ("keys"), and none
    assert data["log_every"] == config.log_every  # the rest is left as it was
    nested = {
        "store": {"uri": f"postgresql://u:{PASSWORD}@db:5432/x", "api_key": SecretStr(PASSWORD)},
        "Auth_Token": SecretStr(PASSWORD), "layer_keys": "path", "primary_key": "step",
        "paths": ["file:///tmp/a@b", f"s3://k:{PASSWORD}@bucket/x"],
        "query": f"https://host/api?user=bob&access_token={PASSWORD}",
    }  # fmt: skip
    assert redacted_config(nested) == {
        "store": {"uri": "postgresql://***@db:5432/x", "api_key": MASK},  # (not a URI)
        "Auth_Token": MASK, "layer_keys": "path", "primary_key": "step",
        "paths": ["file:///tmp/a@b", "s3://***@bucket/x"],
        "query": "https://host/api?user=bob&access_token=***",
    }  # fmt: skip


@pytest.mark.slow
def test_the_run_config_has_layer_keys_and_no_password_in_any_file_of_the_run(
    offline_wandb: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    model = nn.Linear(3, 1)
    with gradtrack.watch(
        model, backend="wandb", log_every=1, layer_keys="depth",
        wandb={"mode": "offline", "dir": str(offline_wandb), "project": "gradtrack-tests"},
        mlflow={"tracking_uri": f"http://alice:{PASSWORD}@mlflow.example:5000"},
    ):  # fmt: skip
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
    wandb.teardown()

    (run_dir,) = run_dirs(offline_wandb)
    (run,) = of_type(read_records(run_dir), "run")
    written = run["config"]["update"]["gradtrack"]
    assert written["layer_keys"] == "depth"  # it was dropped for its name before SecretStr
    # The secret URI was written with its login masked (the run still names its server).
    assert written["mlflow"]["tracking_uri"] == "http://***@mlflow.example:5000"
    assert written["mlflow"]["experiment"] == "gradtrack"
    files = [path for path in offline_wandb.rglob("*") if path.is_file()]
    assert any(path.suffix == ".wandb" for path in files)
    leaked = [path for path in files if PASSWORD.encode() in path.read_bytes()]
    assert leaked == []
    out, err = capfd.readouterr()
    assert PASSWORD not in out + err
