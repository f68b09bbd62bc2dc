"""docker-compose.yml: no Docker engine runs here, so check the file's structure.

The topology itself — `mlflow server` on a PostgreSQL backend store — runs for real in
tests/sinks/test_mlflow.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


def test_services_and_pinned_images(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"postgres", "minio", "create-bucket", "mlflow"}
    assert services["mlflow"]["image"].startswith("ghcr.io/mlflow/mlflow:v")
    for name, service in services.items():
        image, _, tag = service["image"].rpartition(":")
        assert image and tag and tag != "latest" and "/" not in tag, (name, service["image"])


def test_mlflow_runs_on_postgres_with_proxied_s3_artifacts(compose: dict[str, Any]) -> None:
    mlflow = compose["services"]["mlflow"]
    command = " ".join(mlflow["command"])
    assert mlflow["environment"]["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql://")
    # The URI (with the database password) comes from the environment, not the command line.
    assert "--backend-store-uri" not in command and "--serve-artifacts" in command
    assert "MLFLOW_BACKEND_STORE_URI" not in command
    assert '--artifacts-destination "s3://${MLFLOW_BUCKET:?set MLFLOW_BUCKET in .env}"' in command
    assert mlflow["environment"]["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert mlflow["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert mlflow["depends_on"]["create-bucket"]["condition"] == "service_completed_successfully"
    bucket = " ".join(compose["services"]["create-bucket"]["entrypoint"])
    assert "mc mb --ignore-existing" in bucket


def test_healthchecks_and_named_volumes(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in ("postgres", "minio", "mlflow"):
        assert services[name]["healthcheck"]["test"], name
    assert set(compose["volumes"]) == {"postgres-data", "minio-data"}
    assert "postgres-data:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    assert "minio-data:/data" in services["minio"]["volumes"]


def test_every_published_port_is_bound_to_loopback(compose: dict[str, Any]) -> None:
    ports = [p for s in compose["services"].values() for p in s.get("ports", [])]
    assert ports and all(str(p).startswith("127.0.0.1:") for p in ports)


def test_no_secret_in_the_file_and_only_the_example_env_is_committed(
    compose: dict[str, Any],
) -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    used = set(re.findall(r"\$\{(\w+)", text))
    # Every variable is required: compose refuses to start with one unset or empty.
    assert re.findall(r"\$\{(\w+)(?::\?[^}]*)?\}", text) == re.findall(r"\$\{(\w+)", text)
    assert all(f"${{{name}:?" in text for name in used)
    example = dict(
        line.split("=", 1)
        for line in (ROOT / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert used == set(example)
    for service in compose["services"].values():
        for key, value in service.get("environment", {}).items():
            if re.search("PASSWORD|SECRET|KEY", key):
                assert re.fullmatch(r"\$\{\w+:\?[^}]*\}", str(value)), key
    assert ".env" in (ROOT / ".gitignore").read_text().splitlines()
    assert not (ROOT / ".env").exists() or ".env" in (ROOT / ".gitignore").read_text()
