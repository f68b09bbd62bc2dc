"""docker-compose.yml: no Docker engine runs here, so check the file's structure.

The topology itself — `mlflow server` on a PostgreSQL backend store — runs for real in
tests/sinks/test_mlflow.py, MLflow's basic-auth app in tests/sinks/test_mlflow_auth.py.
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
ROOT = Path(__file__).resolve().parents[1]
# The TLS proxy's settings: compose reads a profile's variables even when it is not started,
# so these have defaults; every other variable is required.
OPTIONAL = {"GRADTRACK_TLS_HOST", "GRADTRACK_TLS", "GRADTRACK_TLS_PORT"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


def test_services_and_pinned_images(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {
        "postgres", "create-auth-db", "minio", "create-bucket", "mlflow", "tls-proxy",
    }  # fmt: skip
    for name, service in services.items():
        image, _, tag = service["image"].rpartition(":")
        assert image and tag and tag != "latest" and "/" not in tag, (name, service["image"])
    # MLflow's image is built on the official one, pinned, with the auth app's packages of
    # the same version (and tagged with it).
    assert services["mlflow"]["build"] == "deploy/mlflow"
    dockerfile = (ROOT / "deploy/mlflow/Dockerfile").read_text()
    (version,) = re.findall(r"^ARG MLFLOW_VERSION=(\d+\.\d+\.\d+)$", dockerfile, re.M)
    assert "FROM ghcr.io/mlflow/mlflow:v${MLFLOW_VERSION}-full" in dockerfile
    assert 'pip install --no-cache-dir "mlflow[auth]==${MLFLOW_VERSION}"' in dockerfile
    assert services["mlflow"]["image"].endswith(f":{version}")


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


def test_only_the_team_gets_in_users_in_postgres(compose: dict[str, Any]) -> None:
    """MLflow's basic-auth app, its secrets required, its users and permissions in their own
    PostgreSQL database, reached through libpq's variables (no password in its config file)."""
    mlflow = compose["services"]["mlflow"]
    environment = mlflow["environment"]
    assert "mlflow server --app-name basic-auth " in " ".join(mlflow["command"])
    for secret in ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"):
        assert environment[secret] == f"${{{secret}:?set {secret} in .env}}"
    assert environment["MLFLOW_AUTH_CONFIG_PATH"] == "/etc/mlflow/basic_auth.ini"
    assert (
        "COPY basic_auth.ini /etc/mlflow/basic_auth.ini"
        in (ROOT / "deploy/mlflow/Dockerfile").read_text()
    )
    config = configparser.ConfigParser()
    config.read(ROOT / "deploy/mlflow/basic_auth.ini")
    assert config["mlflow"]["database_uri"] == "postgresql://"
    assert "admin_password" not in config["mlflow"]
    assert environment["PGHOST"] == "postgres" and environment["PGDATABASE"] == "mlflow_auth"
    assert environment["PGPASSWORD"] == "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD in .env}"
    create = compose["services"]["create-auth-db"]
    assert 'CREATE DATABASE mlflow_auth"' in " ".join(create["entrypoint"])
    assert create["environment"]["PGHOST"] == "postgres"
    assert mlflow["depends_on"]["create-auth-db"]["condition"] == "service_completed_successfully"
    assert create["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_the_tls_proxy_is_opt_in_and_fronts_mlflow(compose: dict[str, Any]) -> None:
    proxy = compose["services"]["tls-proxy"]
    assert proxy["profiles"] == ["tls"]
    assert proxy["depends_on"]["mlflow"]["condition"] == "service_healthy"
    assert "./deploy/caddy/Caddyfile:/etc/caddy/Caddyfile:ro" in proxy["volumes"]
    caddyfile = (ROOT / "deploy/caddy/Caddyfile").read_text()
    assert re.search(r"^\{\$GRADTRACK_TLS_HOST\} \{$", caddyfile, re.M)
    assert "\ttls {$GRADTRACK_TLS}\n\treverse_proxy mlflow:5000\n" in caddyfile
    assert proxy["environment"] == {
        "GRADTRACK_TLS_HOST": "${GRADTRACK_TLS_HOST:-localhost}",
        "GRADTRACK_TLS": "${GRADTRACK_TLS:-internal}",
    }
    # MLflow answers the name the proxy's clients use (its host check), and the browser UI
    # behind it (its CORS check).
    command = " ".join(compose["services"]["mlflow"]["command"])
    assert ',${GRADTRACK_TLS_HOST:-localhost}:*"' in command
    assert ',https://${GRADTRACK_TLS_HOST:-localhost}:*"' in command
    assert "deploy/caddy/certs/" in (ROOT / ".gitignore").read_text().splitlines()


def test_healthchecks_and_named_volumes(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in ("postgres", "minio", "mlflow"):
        assert services[name]["healthcheck"]["test"], name
    assert set(compose["volumes"]) == {"postgres-data", "minio-data", "caddy-data", "caddy-config"}
    assert "postgres-data:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    assert "minio-data:/data" in services["minio"]["volumes"]


def test_only_the_tls_proxy_is_published_beyond_loopback_and_only_when_enabled(
    compose: dict[str, Any],
) -> None:
    services = compose["services"].values()
    default = [p for s in services if "profiles" not in s for p in s.get("ports", [])]
    assert default and all(str(p).startswith("127.0.0.1:") for p in default)
    beyond = {
        name: port
        for name, service in compose["services"].items()
        for port in service.get("ports", [])
        if not str(port).startswith("127.0.0.1:")
    }
    assert beyond == {"tls-proxy": "${GRADTRACK_TLS_PORT:-443}:443"}


def test_no_secret_in_the_file_and_only_the_example_env_is_committed(
    compose: dict[str, Any],
) -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    used = set(re.findall(r"\$\{(\w+)", text))
    # Every variable but the proxy's settings is required: compose refuses to start with one
    # unset or empty. Those have defaults, and never a secret.
    required = re.findall(r"\$\{(\w+):\?[^}]*\}", text)
    defaulted = re.findall(r"\$\{(\w+):-[\w.-]*\}", text)
    assert sorted(required + defaulted) == sorted(re.findall(r"\$\{(\w+)", text))
    assert set(defaulted) == OPTIONAL and not OPTIONAL & set(required)
    lines = (ROOT / ".env.example").read_text().splitlines()
    example = dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))
    assert set(example) == used - OPTIONAL
    assert {line[1:].split("=")[0] for line in lines if re.match(r"#\w+=", line)} == OPTIONAL
    for service in compose["services"].values():
        for key, value in service.get("environment", {}).items():
            if re.search("PASSWORD|SECRET|KEY", key):
                assert re.fullmatch(r"\$\{\w+:\?[^}]*\}", str(value)), key
    assert ".env" in (ROOT / ".gitignore").read_text().splitlines()
    assert not (ROOT / ".env").exists() or ".env" in (ROOT / ".gitignore").read_text()
