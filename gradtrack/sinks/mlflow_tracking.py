"""The few MLflow calls the MLflow sink makes, over one of two transports.

A tracking server is called with MLflow's own REST helpers but without their minutes-long
retry loop (the sink buffers and retries itself); any other URI (the embedded SQLite default,
a database URI) goes through `MlflowClient`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

# Request limits of MLflow's log-batch endpoint (mlflow/utils/validation.py).
MAX_METRICS_PER_BATCH = 1000
MAX_TAGS_PER_BATCH = 100
MAX_ITEMS_PER_BATCH = 1000


class PermanentError(Exception):
    """MLflow refused a request for what it holds; resending it would fail again."""


class AuthError(Exception):
    """The server refused the request: no valid login (HTTP 401), or the user lacks the
    ``permission`` it needs (HTTP 403). Nothing was stored, and everything can go once that
    is fixed, so it is kept and retried."""

    def __init__(self, status: int, endpoint: str, permission: str) -> None:
        super().__init__(f"HTTP {status} on {endpoint}")
        self.status = status
        self.endpoint = endpoint
        self.permission = permission  # what MLflow's basic-auth app checks: READ or EDIT


class UntrustedTlsError(Exception):
    """This process does not trust the server's TLS certificate (self-signed, a private CA):
    nothing was sent, and everything can go once it does, so it is kept and retried."""


Refusal = AuthError | UntrustedTlsError


class Tracking(Protocol):
    def experiment_id(self, name: str) -> str: ...

    def create_run(self, experiment_id: str, run_name: str | None) -> tuple[str, str]:
        """A new run's id and artifact URI."""

    def artifact_uri(self, run_id: str) -> str: ...

    def log_batch(
        self, run_id: str, metrics: list[tuple[str, float, int, int]], tags: list[tuple[str, str]]
    ) -> None:
        """Metrics as (key, value, timestamp_ms, step); tags as (key, value)."""

    def log_artifact(
        self, run_id: str, artifact_uri: str, local: Path, artifact_dir: str
    ) -> None: ...

    def end_run(self, run_id: str, status: str) -> None:
        """Mark the run FINISHED, FAILED or KILLED."""

    def close(self) -> None:
        """Release connections and files."""


def connect(tracking_uri: str, timeout_s: float) -> Tracking:
    if tracking_uri.startswith(("http://", "https://")):
        return RestTracking(tracking_uri, timeout_s)
    return ClientTracking(tracking_uri)


class ClientTracking:
    """Through `MlflowClient`: local stores, where there is no network to fail."""

    def __init__(self, tracking_uri: str) -> None:
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri)

    def experiment_id(self, name: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return str(experiment.experiment_id)
        return str(self.client.create_experiment(name))

    def create_run(self, experiment_id: str, run_name: str | None) -> tuple[str, str]:
        run = self.client.create_run(experiment_id, run_name=run_name)
        return run.info.run_id, run.info.artifact_uri

    def artifact_uri(self, run_id: str) -> str:
        return str(self.client.get_run(run_id).info.artifact_uri)

    def log_batch(
        self, run_id: str, metrics: list[tuple[str, float, int, int]], tags: list[tuple[str, str]]
    ) -> None:
        from mlflow.entities import Metric, RunTag
        from mlflow.exceptions import MlflowException

        try:
            self.client.log_batch(
                run_id,
                metrics=[Metric(k, v, t, s) for k, v, t, s in metrics],
                tags=[RunTag(k, v) for k, v in tags],
                synchronous=True,
            )
        except MlflowException as exc:
            if exc.error_code == "INVALID_PARAMETER_VALUE":
                raise PermanentError(str(exc)) from exc
            raise

    def log_artifact(self, run_id: str, artifact_uri: str, local: Path, artifact_dir: str) -> None:
        self.client.log_artifact(run_id, str(local), artifact_dir)

    def end_run(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status)

    def close(self) -> None:
        # The embedded SQL store keeps a pool of connections (open files) to its database.
        store = getattr(getattr(self.client, "_tracking_client", None), "store", None)
        engine = getattr(store, "engine", None)
        if engine is not None:
            engine.dispose()


class RestTracking:
    """A tracking server over HTTP, one attempt per call with a timeout."""

    def __init__(self, tracking_uri: str, timeout_s: float) -> None:
        from mlflow.tracking._tracking_service.utils import get_default_host_creds

        self.tracking_uri = tracking_uri
        self.creds = get_default_host_creds(tracking_uri)
        self.timeout_s = timeout_s

    def _call(self, endpoint: str, method: str = "POST", **kwargs: Any) -> dict[str, Any]:
        from mlflow.exceptions import MlflowException
        from mlflow.utils.rest_utils import http_request, verify_rest_response

        try:
            response = http_request(
                self.creds, endpoint, method, max_retries=0, backoff_factor=0,
                timeout=self.timeout_s, **kwargs,
            )  # fmt: skip
        except MlflowException as exc:
            if _failed_tls(exc):
                raise UntrustedTlsError(str(exc.__context__)) from exc
            raise
        try:
            verify_rest_response(response, endpoint)
        except MlflowException as exc:
            if response.status_code in (401, 403):
                # Reading needs READ on the experiment; creating runs and logging, EDIT.
                permission = "READ" if method == "GET" else "EDIT"
                raise AuthError(response.status_code, endpoint, permission) from exc
            if 400 <= response.status_code < 500 and response.status_code != 429:
                raise PermanentError(str(exc)) from exc
            raise
        return response.json() if response.content else {}

    def experiment_id(self, name: str) -> str:
        try:
            found = self._call(
                "/api/2.0/mlflow/experiments/get-by-name", "GET",
                params={"experiment_name": name},
            )  # fmt: skip
            return str(found["experiment"]["experiment_id"])
        except PermanentError:
            created = self._call("/api/2.0/mlflow/experiments/create", json={"name": name})
            return str(created["experiment_id"])

    def create_run(self, experiment_id: str, run_name: str | None) -> tuple[str, str]:
        body: dict[str, Any] = {"experiment_id": experiment_id, "start_time": _now_ms()}
        if run_name:
            body["run_name"] = run_name
        info = self._call("/api/2.0/mlflow/runs/create", json=body)["run"]["info"]
        return info["run_id"], info["artifact_uri"]

    def artifact_uri(self, run_id: str) -> str:
        found = self._call("/api/2.0/mlflow/runs/get", "GET", params={"run_id": run_id})
        return str(found["run"]["info"]["artifact_uri"])

    def log_batch(
        self, run_id: str, metrics: list[tuple[str, float, int, int]], tags: list[tuple[str, str]]
    ) -> None:
        from mlflow.entities import Metric, RunTag
        from mlflow.protos.service_pb2 import LogBatch
        from mlflow.utils.proto_json_utils import message_to_json

        request = LogBatch(
            run_id=run_id,
            metrics=[Metric(k, v, t, s).to_proto() for k, v, t, s in metrics],
            tags=[RunTag(k, v).to_proto() for k, v in tags],
        )
        # message_to_json writes NaN/Inf as the strings protobuf's JSON mapping expects.
        self._call("/api/2.0/mlflow/runs/log-batch", json=json.loads(message_to_json(request)))

    def log_artifact(self, run_id: str, artifact_uri: str, local: Path, artifact_dir: str) -> None:
        uri = urlparse(artifact_uri)
        if uri.scheme != "mlflow-artifacts":  # not proxied by the server: MLflow's own client
            ClientTracking(self.tracking_uri).log_artifact(
                run_id, artifact_uri, local, artifact_dir
            )
            return
        path = uri.path.strip("/")
        with local.open("rb") as data:
            self._call(
                f"/api/2.0/mlflow-artifacts/artifacts/{path}/{artifact_dir}/{local.name}", "PUT",
                data=data,
            )  # fmt: skip

    def end_run(self, run_id: str, status: str) -> None:
        self._call(
            "/api/2.0/mlflow/runs/update",
            json={"run_id": run_id, "status": status, "end_time": _now_ms()},
        )

    def close(self) -> None:
        return None  # one request per call: nothing stays open


def _failed_tls(error: Exception) -> bool:
    """MLflow's client wraps the failure it met in its own exception, chained implicitly."""
    import requests

    return isinstance(error.__context__, requests.exceptions.SSLError)


def _now_ms() -> int:
    return int(time.time() * 1000)
