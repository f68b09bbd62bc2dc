"""MLflow's side of the MLflow sink: the run it logs to, the calls it makes, and what a
refusal tells the user.

The run (`MlflowRun`) is the one given, else the caller's active run, else one gradtrack
starts: in the caller's thread at once when it can share it with the caller's own
``mlflow.*`` calls, otherwise at the first write.

The calls (`Tracking`) go over one of two transports. A tracking server is called with
MLflow's own REST helpers but without their minutes-long retry loop (the sink's courier
retries itself); any other URI (the embedded SQLite default, a database URI) goes through
`MlflowClient`.

A refusal (`AuthError`, `UntrustedTlsError`) is worded by `refusal_message`: which of
MLflow's variables to set, or which permission on which experiment the user lacks — and that
nothing is lost meanwhile. gradtrack takes no credentials of its own: MLflow's client reads
MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN), and for TLS
MLFLOW_TRACKING_SERVER_CERT_PATH / MLFLOW_TRACKING_INSECURE_TLS, from the environment at each
connection, so only the user name, never a secret, appears here.
"""

from __future__ import annotations

import atexit
import math
import os
import re
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from gradtrack import lifecycle
from gradtrack.config import MlflowOptions
from gradtrack.config.models import redact
from gradtrack.log import logger, report


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
                self.creds,
                endpoint,
                method,
                max_retries=0,
                backoff_factor=0,
                timeout=self.timeout_s,
                **kwargs,
            )
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
                "/api/2.0/mlflow/experiments/get-by-name",
                "GET",
                params={"experiment_name": name},
            )
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
        self._call("/api/2.0/mlflow/runs/log-batch", json=log_batch_body(run_id, metrics, tags))

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
                f"/api/2.0/mlflow-artifacts/artifacts/{path}/{artifact_dir}/{local.name}",
                "PUT",
                data=data,
            )

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


def log_batch_body(
    run_id: str, metrics: list[tuple[str, float, int, int]], tags: list[tuple[str, str]]
) -> dict[str, Any]:
    """The JSON body of a ``runs/log-batch`` request, as MLflow's REST API documents it (and
    as MLflow's own client writes it): a non-finite value is the string protobuf's JSON
    mapping reads, an empty list is left out.

    >>> log_batch_body("r1", [("g", float("-inf"), 1000, 3)], [])["metrics"]
    [{'key': 'g', 'value': '-Infinity', 'timestamp': 1000, 'step': 3}]
    """
    body: dict[str, Any] = {"run_id": run_id}
    if metrics:
        body["metrics"] = [
            {"key": key, "value": _json_double(value), "timestamp": timestamp, "step": step}
            for key, value, timestamp, step in metrics
        ]
    if tags:
        body["tags"] = [{"key": key, "value": value} for key, value in tags]
    return body


def _json_double(value: float) -> float | str:
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def _now_ms() -> int:
    return int(time.time() * 1000)


# -- refusals, in words --------------------------------------------------------------------
USERNAME = "MLFLOW_TRACKING_USERNAME"
PASSWORD = "MLFLOW_TRACKING_PASSWORD"
TOKEN = "MLFLOW_TRACKING_TOKEN"
CERT_PATH = "MLFLOW_TRACKING_SERVER_CERT_PATH"
INSECURE_TLS = "MLFLOW_TRACKING_INSECURE_TLS"
KEPT = (
    "nothing is lost: the steps stay in gradtrack's spool and are retried, and "
    "`gradtrack sync` (run where those variables are right) delivers what this run could not"
)


def refusal_message(
    error: Refusal, tracking_uri: str | None, experiment: str, env: Mapping[str, str] = os.environ
) -> str:
    """One message for a 401/403 or an untrusted certificate at first contact;
    ``experiment`` names where the run is, ``env`` holds MLflow's variables.

    >>> from gradtrack.sinks.mlflow_tracking import AuthError
    >>> error = AuthError(403, "/api/2.0/mlflow/runs/create", "EDIT")
    >>> print(refusal_message(
    ...     error, "https://mlflow.team", "experiment 'vision' (id 4)", {USERNAME: "bob"}
    ... ))  # doctest: +ELLIPSIS
    MLflow at https://mlflow.team denied user 'bob' EDIT permission on experiment 'vision' (id 4)
    (HTTP 403 on /api/2.0/mlflow/runs/create): an admin grants it (docs/team-server.md), or set
    MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD to a user who has it; nothing is lost...
    """
    if isinstance(error, UntrustedTlsError):
        return (
            f"gradtrack does not trust the TLS certificate of MLflow at {tracking_uri} "
            f"({error}): set {CERT_PATH} to the certificate of the CA that signed it "
            f"(docs/team-server.md), or {INSECURE_TLS}=true to skip the check; {KEPT}"
        )
    user = env.get(USERNAME)
    if error.status == 403:
        who = f"user {user!r}" if user else f"the user of {TOKEN}"
        return (
            f"MLflow at {tracking_uri} denied {who} {error.permission} permission on "
            f"{experiment} ({error}): an admin grants it (docs/team-server.md), or set {USERNAME} "
            f"and {PASSWORD} to a user who has it; {KEPT}"
        )
    if user:
        return (
            f"MLflow at {tracking_uri} refused the login of user {user!r} ({error}): check "
            f"{PASSWORD} (and {USERNAME}); {KEPT}"
        )
    if env.get(TOKEN):
        return f"MLflow at {tracking_uri} refused the token in {TOKEN} ({error}); {KEPT}"
    return (
        f"MLflow at {tracking_uri} requires a login and this process has none ({error}): set "
        f"{USERNAME} and {PASSWORD} (or {TOKEN}) where training runs; {KEPT}"
    )


# -- the run ------------------------------------------------------------------------------
class MlflowRun:
    """Where the run is (tracking URI, run id), who started it, and the connection to it."""

    def __init__(self, options: MlflowOptions, run_id: str | None = None) -> None:
        self.options = options
        given = options.tracking_uri.get_secret_value() if options.tracking_uri else None
        self.tracking_uri = given or os.environ.get("MLFLOW_TRACKING_URI")
        self.run_id = run_id
        self.owns_run = False
        # The run is also MLflow's active run in the thread that made this sink (the user's).
        self.shares_run = False
        self.ended = False  # gradtrack ended the run it started
        self.artifact_uri: str | None = None
        self._experiment_id: str | None = None
        self._tracking: Tracking | None = None
        self._sharing_thread: int | None = None  # the thread whose active run it is
        if run_id is None and "mlflow" in sys.modules:  # only then can a run be active
            import mlflow

            active = mlflow.active_run()
            if active is not None:  # captured here: MLflow's active run is per thread
                self.run_id = active.info.run_id
                self.tracking_uri = self.tracking_uri or mlflow.get_tracking_uri()
                self.shares_run = True

    def begin(self, run_id: str | None) -> None:
        """Called once the sink is made: start a run to share now, if the options ask for it
        and no run was given or found; say which run it is when it is the caller's."""
        if run_id is None and self.run_id is None and self.options.share_run:
            self._start_shared()
        if self.shares_run and not self.owns_run:
            logger.info("%s", self.where())

    def _start_shared(self) -> None:
        """Start gradtrack's run now, in the caller's thread, and make it MLflow's active run
        there (its fluent API): the user's own ``mlflow.log_metric`` / ``log_param`` land in
        the same run, not in a second one. Only where the fluent API points at the same store;
        a store that cannot be reached now leaves the run to the first write, as before."""
        import mlflow

        if self.tracking_uri not in (None, mlflow.get_tracking_uri()):
            logger.info(
                "gradtrack logs to MLflow at %s; mlflow.* calls of your own go to %s",
                redact(self.tracking_uri or ""),
                redact(mlflow.get_tracking_uri()),
            )
            return
        try:
            self.start()
            mlflow.start_run(run_id=self.run_id)
        except Exception as exc:
            report(
                f"gradtrack could not start its MLflow run now ({exc!r}); it starts it at "
                "its first write, and your own mlflow.* calls go to a run of their own"
            )
            return
        self.shares_run = True
        self._sharing_thread = threading.get_ident()
        # MLflow's own exit hook (registered when mlflow was imported) ends the active run
        # FINISHED; ours, registered after it, runs first: the run ends as training ended.
        atexit.unregister(_close_watchers_before_mlflow_exits)
        atexit.register(_close_watchers_before_mlflow_exits)
        logger.info("%s", self.where())

    def connection(self) -> Tracking:
        if self._tracking is None:
            if self.tracking_uri is None:
                import mlflow

                self.tracking_uri = mlflow.get_tracking_uri()
            self._tracking = connect(self.tracking_uri, self.options.request_timeout_s)
        return self._tracking

    def start(self) -> None:
        """Create gradtrack's own run."""
        tracking = self.connection()
        self._experiment_id = tracking.experiment_id(self.options.experiment)
        self.run_id, self.artifact_uri = tracking.create_run(
            self._experiment_id, self.options.run_name
        )
        self.owns_run = True

    def started(self) -> str:
        """The run's id, starting the run first if there is none yet."""
        if self.run_id is None:
            self.start()
            logger.info("%s", self.where())
        assert self.run_id is not None
        return self.run_id

    def where(self) -> str:
        """One line: which run, and how to look at it."""
        uri = self.tracking_uri or ""
        look = (
            f"open {uri}"
            if uri.startswith(("http://", "https://"))
            else f"look with: mlflow ui --backend-store-uri {uri}"
        )
        own = "your active run" if not self.owns_run else "started by gradtrack"
        shared = "; your own mlflow.log_* calls land in it too" if self.shares_run else ""
        return redact(f"MLflow run {self.run_id} ({own}{shared}) at {uri}; {look}")

    def experiment(self) -> str:
        """The experiment the run is in, in words, for a refusal's message."""
        if self.run_id is not None and self._experiment_id is None:
            return f"the experiment of run {self.run_id}"  # a run gradtrack did not start
        known = f" (id {self._experiment_id})" if self._experiment_id else ""
        return f"experiment {self.options.experiment!r}{known}"

    def adopt(self, target: dict[str, Any]) -> None:
        """Follow a copy in another process (a worker process's `MlflowSink.spool_target`):
        the run it started, whether it is gradtrack's, and whether it ended it."""
        self.run_id = target.get("run_id") or self.run_id
        self.owns_run = bool(target.get("owns_run"))
        self.ended = bool(target.get("ended"))

    def end(self, outcome: str) -> None:
        """End the run gradtrack started (a run of the user's is theirs to end)."""
        if not (self.owns_run and self.run_id is not None):
            return
        try:
            self.connection().end_run(self.run_id, outcome)
            self.ended = True
        except Exception as exc:
            report(f"gradtrack could not end MLflow run {self.run_id}: {exc!r}")

    def end_shared(self, outcome: str) -> None:
        """The run gradtrack started stops being MLflow's active run in the calling thread,
        so the user's next ``mlflow.start_run`` (or the next ``watch``) starts a new run
        instead of writing into this one. A run gradtrack ended is ended there the fluent way;
        one still owed steps (a close that timed out, a spool left for ``gradtrack sync``)
        keeps its status and is only let go."""
        if not (self.shares_run and self.owns_run):
            return
        if threading.get_ident() != self._sharing_thread:
            # Closed at exit by gradtrack's exit thread: MLflow's active run is the main
            # thread's, ended by MLflow's exit hook; ours runs just before it, there.
            _ENDS_AT_EXIT.append((self, outcome))
            return
        import mlflow

        active = mlflow.active_run()
        if active is None or active.info.run_id != self.run_id:
            return  # the user ended it, or started another on top
        if self.ended:
            mlflow.end_run(outcome)
            return
        # MLflow's only public way out, end_run, also marks the run ended (with its client's
        # minutes-long retries when the server is away): take it off this thread's stack of
        # active runs instead (mlflow.tracking.fluent, checked with mlflow 3.17).
        from mlflow.tracking import fluent

        stack = fluent._active_run_stack.get()
        if stack and stack[-1].info.run_id == self.run_id:
            stack.pop()

    def close(self) -> None:
        if self._tracking is not None:
            self._tracking.close()  # e.g. the embedded store's database connections


_ENDS_AT_EXIT: list[tuple[MlflowRun, str]] = []


def _close_watchers_before_mlflow_exits() -> None:
    """Before MLflow's own exit hook (which ends the active run FINISHED), in the main
    thread: close what is still open, and end shared runs with how training ended."""
    lifecycle.close_open_watchers()
    while _ENDS_AT_EXIT:
        run, outcome = _ENDS_AT_EXIT.pop(0)
        try:
            run.end_shared(outcome)
        except Exception as exc:
            report(f"gradtrack could not end MLflow run {run.run_id}: {exc!r}")


def portable_uri(uri: str | None) -> str | None:
    """``uri`` as another process in another folder can use it: credentials dropped (MLflow
    takes them from its variables), a relative sqlite or file store made absolute.

    >>> portable_uri("http://alice:pw@mlflow.example:5000")
    'http://mlflow.example:5000'
    >>> portable_uri("sqlite:////data/mlflow.db")
    'sqlite:////data/mlflow.db'
    """
    if uri is None:
        return None
    uri = re.sub(r"^([a-zA-Z][a-zA-Z0-9+.\-]*://)[^/@\s]+@", r"\1", uri)
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(uri.removeprefix("sqlite:///")).resolve())
    if "://" not in uri:
        return str(Path(uri).resolve())
    return uri
