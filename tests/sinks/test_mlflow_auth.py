"""gradtrack against MLflow's own authentication (`mlflow server --app-name basic-auth`, a
real server process): credentials only from MLflow's variables, one clear message when the
server refuses, nothing lost, and no password in anything gradtrack prints or writes."""

from __future__ import annotations

import os
import secrets
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import pytest
import torch
from torch import nn

import gradtrack
from tests.conftest import reported
from tests.sinks.mlflow_server import AuthMlflowServer, MlflowServer, TlsMlflowServer
from tests.sinks.test_spool import REPO, run_child, stored_steps, sync_cli

mlflow = pytest.importorskip("mlflow")
yaml = pytest.importorskip("yaml")


Server = TypeVar("Server", bound=MlflowServer)


def serve(kind: type[Server], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server of ``kind`` (sqlite store) for the module."""
    root = tmp_path_factory.mktemp(kind.__name__)
    server = kind(f"sqlite:///{root / 'mlflow.db'}", root)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthMlflowServer]:
    yield from serve(AuthMlflowServer, tmp_path_factory)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsMlflowServer]:
    yield from serve(TlsMlflowServer, tmp_path_factory)


@pytest.fixture
def staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """gradtrack's temporary files (the MLflow sink's staging folder) under the test's folder."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def log_in(monkeypatch: pytest.MonkeyPatch, credentials: dict[str, str]) -> None:
    for name, value in credentials.items():
        monkeypatch.setenv(name, value)


@contextmanager
def as_admin(server: AuthMlflowServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """MLflow's own client of the basic-auth app, logged in as the admin meanwhile."""
    with warnings.catch_warnings():  # the auth app imports a module starlette deprecates
        warnings.filterwarnings("ignore", "starlette.middleware.wsgi is deprecated")
        from mlflow.server import get_app_client

        client = get_app_client("basic-auth", tracking_uri=server.uri)
    with monkeypatch.context() as patch:
        log_in(patch, server.admin_login)
        yield client


def new_user(
    server: AuthMlflowServer, monkeypatch: pytest.MonkeyPatch, user: str
) -> dict[str, str]:
    """A new user's credentials, as MLflow's client takes them."""
    password = secrets.token_urlsafe(18)
    with as_admin(server, monkeypatch) as admin:
        admin.create_user(user, password)
    return {"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password}


def train(watcher_options: dict[str, object], steps: int) -> tuple[gradtrack.Watcher, list[str]]:
    """Train a small model for ``steps`` steps, every one logged; the faults it reported
    (on gradtrack's logger) and the warnings it gave."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught, reported() as told:
        warnings.simplefilter("always")
        watcher = gradtrack.watch(
            model, backend="mlflow", optimizer=optimizer, log_every=1, **watcher_options
        )
        for _ in range(steps):
            optimizer.zero_grad()
            model(torch.randn(16, 8)).pow(2).mean().backward()
            optimizer.step()
        watcher.close()
    return watcher, told + [str(w.message) for w in caught]


def assert_nowhere(secret: str, texts: Iterable[str], places: Iterable[Path]) -> None:
    """``secret`` in none of the texts, nor in any file at or under the places."""
    for text in texts:
        assert secret not in text
    files = [f for place in places for f in [place, *place.rglob("*")] if f.is_file()]
    assert files
    for file in files:
        assert secret.encode() not in file.read_bytes(), file


@pytest.mark.slow
def test_with_credentials_every_step_reaches_an_authenticated_server(
    server: AuthMlflowServer, monkeypatch: pytest.MonkeyPatch, spool_in_tmp: Path, staging: Path
) -> None:
    credentials = new_user(server, monkeypatch, "alice")
    log_in(monkeypatch, credentials)
    options = {"tracking_uri": server.uri, "experiment": "alice", "send_every_s": 0}
    watcher, messages = train({"mlflow": options}, steps=40)
    run_id = watcher.sinks[0].run_id
    assert stored_steps(server.uri, run_id) == list(range(40))
    assert messages == [] and not list(spool_in_tmp.iterdir())  # all confirmed, spool gone
    run = mlflow.MlflowClient(server.uri).get_run(run_id)
    stored = [*run.data.tags.values(), *run.data.params.values()]
    password = credentials["MLFLOW_TRACKING_PASSWORD"]
    assert_nowhere(password, stored, [server.root / "mlflow.db", server.root / "artifacts"])


@pytest.mark.slow
def test_without_credentials_one_message_names_the_variables_and_sync_delivers_every_step(
    server: AuthMlflowServer, monkeypatch: pytest.MonkeyPatch, spool_in_tmp: Path, tmp_path: Path
) -> None:
    """A training process with no login (300 steps at the defaults: 30 logged steps) is
    refused at its first request; its steps stay in the spool, a sync without a login keeps
    them, and a sync with the credentials set delivers every one, once."""
    credentials = new_user(server, monkeypatch, "carol")
    temporary = {"TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    child = run_child(server.uri, 300, "close", spool_in_tmp, env=temporary)
    refusals = [line for line in child.splitlines() if "MLFLOW_TRACKING_PASSWORD" in line]
    assert len(refusals) == 1, child
    assert "requires a login" in refusals[0] and "MLFLOW_TRACKING_USERNAME" in refusals[0]
    assert "part of" not in child and "dropped" not in child
    (left,) = list(spool_in_tmp.iterdir())
    assert f"gradtrack sync {left}" in child

    refused = sync_cli(spool_in_tmp, env=temporary)
    assert refused.returncode == 1 and "still undelivered" in refused.stdout, refused.stderr
    assert "MLFLOW_TRACKING_USERNAME" in refused.stderr and left.exists()

    synced = sync_cli(spool_in_tmp, env={**credentials, **temporary})
    assert synced.returncode == 0, synced.stdout + synced.stderr
    assert "30 item(s) delivered" in synced.stdout and not left.exists()
    log_in(monkeypatch, credentials)
    assert stored_steps(server.uri) == list(range(0, 300, 10))  # each once
    outputs = [child, synced.stdout, synced.stderr]
    places = [tmp_path / "tmp", server.root / "mlflow.db", server.root / "artifacts"]
    assert_nowhere(credentials["MLFLOW_TRACKING_PASSWORD"], outputs, places)


@pytest.mark.slow
def test_a_user_without_permission_is_told_which_and_sync_delivers_once_it_is_granted(
    server: AuthMlflowServer, monkeypatch: pytest.MonkeyPatch, spool_in_tmp: Path, staging: Path
) -> None:
    """Every user may READ (the server's default), so bob finds the admin's experiment but
    may not create a run in it: the message names the permission and the experiment, close
    does not wait on a refusal, and once an admin grants EDIT, sync delivers every step."""
    with as_admin(server, monkeypatch):
        experiment = mlflow.MlflowClient(server.uri).create_experiment("vision")
    credentials = new_user(server, monkeypatch, "bob")
    log_in(monkeypatch, credentials)
    options = {"tracking_uri": server.uri, "experiment": "vision", "send_every_s": 0}
    started = time.monotonic()
    _, messages = train({"mlflow": options, "flush_timeout_s": 60}, steps=20)
    assert time.monotonic() - started < 30  # not the 0.8 × 60 s a server outage gets
    refusals = [m for m in messages if "denied user 'bob'" in m]
    assert len(refusals) == 1, messages
    assert f"EDIT permission on experiment 'vision' (id {experiment})" in refusals[0]
    assert not any("part of" in m or "dropped" in m for m in messages)
    (left,) = list(spool_in_tmp.iterdir())
    password = credentials["MLFLOW_TRACKING_PASSWORD"]
    assert_nowhere(password, messages, [left, staging])  # the kept spool and staging files

    with as_admin(server, monkeypatch) as admin:
        admin.grant_user_permission("bob", "experiment", experiment, "EDIT")
    synced = sync_cli(spool_in_tmp, env=credentials)
    assert synced.returncode == 0, synced.stdout + synced.stderr
    (run,) = mlflow.MlflowClient(server.uri).search_runs([experiment])
    assert stored_steps(server.uri, run.info.run_id) == list(range(20))
    assert run.info.status == "FINISHED" and not left.exists()
    assert_nowhere(password, [synced.stdout, synced.stderr], [server.root / "artifacts"])


def test_a_refused_login_names_the_user_and_the_password_variable(
    server: AuthMlflowServer, monkeypatch: pytest.MonkeyPatch, spool_in_tmp: Path, staging: Path
) -> None:
    credentials = new_user(server, monkeypatch, "dave")
    wrong = secrets.token_urlsafe(18)
    log_in(monkeypatch, {**credentials, "MLFLOW_TRACKING_PASSWORD": wrong})
    _, messages = train({"mlflow": {"tracking_uri": server.uri, "experiment": "dave"}}, steps=5)
    refusals = [m for m in messages if "refused the login of user 'dave'" in m]
    assert len(refusals) == 1 and "check MLFLOW_TRACKING_PASSWORD" in refusals[0], messages
    (left,) = list(spool_in_tmp.iterdir())
    assert_nowhere(wrong, messages, [left, staging])


def test_the_admin_password_rotates_as_documented(
    server: AuthMlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/team-server.md: the admin changes its own password with MLflow's client."""
    from mlflow.exceptions import MlflowException

    new = secrets.token_urlsafe(18)
    with as_admin(server, monkeypatch) as admin:
        admin.update_user_password("admin", new, current_password=server.admin_password)
        with pytest.raises(MlflowException, match="401"):
            admin.get_user("admin")  # the old password is refused at once
    server.admin_password = new
    with as_admin(server, monkeypatch) as admin:
        assert admin.get_user("admin").is_admin


@pytest.mark.slow
def test_a_private_ca_is_trusted_through_mlflow_variable_and_named_when_missing(
    tls_server: TlsMlflowServer,
    monkeypatch: pytest.MonkeyPatch,
    spool_in_tmp: Path,
    staging: Path,
) -> None:
    """A server whose certificate this process does not trust (self-signed, as the TLS
    proxy's local CA): one message naming MLflow's variables, the steps kept; with
    MLFLOW_TRACKING_SERVER_CERT_PATH set, sync delivers every one."""
    options = {"tracking_uri": tls_server.uri, "experiment": "tls", "send_every_s": 0}
    _, messages = train({"mlflow": options}, steps=10)
    refusals = [m for m in messages if "does not trust the TLS certificate" in m]
    assert len(refusals) == 1, messages
    assert "MLFLOW_TRACKING_SERVER_CERT_PATH" in refusals[0]
    assert "MLFLOW_TRACKING_INSECURE_TLS" in refusals[0]
    trust = {"MLFLOW_TRACKING_SERVER_CERT_PATH": str(tls_server.certificate)}
    synced = sync_cli(spool_in_tmp, env=trust)
    assert synced.returncode == 0, synced.stdout + synced.stderr
    log_in(monkeypatch, trust)
    client = mlflow.MlflowClient(tls_server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tls").experiment_id])
    assert stored_steps(tls_server.uri, run.info.run_id) == list(range(10))


@pytest.mark.slow
def test_the_compose_auth_config_keeps_users_in_postgres_without_a_password_in_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spool_in_tmp: Path, staging: Path
) -> None:
    """The compose stack's auth settings, for real: its one-shot service's command creates
    the mlflow_auth database (twice: it must be idempotent), and the basic-auth app with
    deploy/mlflow/basic_auth.ini reaches it through libpq's PG* variables alone."""
    uri = os.environ.get("POSTGRES_TEST_URI")
    if not uri:
        if os.environ.get("CI"):
            pytest.fail("CI must provide POSTGRES_TEST_URI (.ci/run starts PostgreSQL)")
        pytest.skip("no PostgreSQL here: set POSTGRES_TEST_URI (as .ci/run does)")
    address = urlparse(uri)
    libpq = {
        "PGHOST": address.hostname or "", "PGPORT": str(address.port or 5432),
        "PGUSER": address.username or "", "PGPASSWORD": address.password or "",
        "PGDATABASE": address.path.lstrip("/"),
    }  # fmt: skip
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    create = compose["services"]["create-auth-db"]["entrypoint"]
    psql = {**os.environ, **libpq}
    subprocess.run(["psql", "-qc", "DROP DATABASE IF EXISTS mlflow_auth"], env=psql, check=True)
    for _ in range(2):
        subprocess.run(create, env=psql, check=True, capture_output=True)

    auth_db = {**libpq, "PGDATABASE": "mlflow_auth"}
    config = REPO / "deploy/mlflow/basic_auth.ini"
    server = AuthMlflowServer(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path, config, auth_db)
    server.start()
    try:
        credentials = new_user(server, monkeypatch, "erin")
        log_in(monkeypatch, credentials)
        watcher, messages = train({"mlflow": {"tracking_uri": server.uri}}, steps=3)
        assert stored_steps(server.uri, watcher.sinks[0].run_id) == [0, 1, 2], messages
    finally:
        server.stop()
    users = subprocess.run(
        ["psql", "-tAc", "SELECT username FROM users ORDER BY id"],
        env={**psql, **auth_db}, check=True, capture_output=True, text=True,
    )  # fmt: skip
    assert users.stdout.split() == ["admin", "erin"]
