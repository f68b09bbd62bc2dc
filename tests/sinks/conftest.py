"""Fixtures for backend tests: one real MLflow server per test session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sinks.mlflow_server import MlflowServer


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    pytest.importorskip("mlflow")
    root: Path = tmp_path_factory.mktemp("mlflow-server")
    server = MlflowServer(f"sqlite:///{root / 'mlflow.db'}", root).start()
    yield server
    server.stop()
