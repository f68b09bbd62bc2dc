"""Which MLflow run the MLflow sink logs to, and how that run starts and ends.

The run is the one given, else the caller's active run, else one gradtrack starts: in the
caller's thread at once when it can share it with the caller's own ``mlflow.*`` calls,
otherwise at the first write.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
from pathlib import Path

from gradtrack import lifecycle
from gradtrack.config import MlflowOptions
from gradtrack.config.redact import redact
from gradtrack.log import logger, report
from gradtrack.sinks.mlflow_tracking import Tracking, connect


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
                redact(self.tracking_uri or ""), redact(mlflow.get_tracking_uri()),
            )  # fmt: skip
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
            f"open {uri}" if uri.startswith(("http://", "https://"))
            else f"look with: mlflow ui --backend-store-uri {uri}"
        )  # fmt: skip
        own = "your active run" if not self.owns_run else "started by gradtrack"
        shared = "; your own mlflow.log_* calls land in it too" if self.shares_run else ""
        return redact(f"MLflow run {self.run_id} ({own}{shared}) at {uri}; {look}")

    def experiment(self) -> str:
        """The experiment the run is in, in words, for a refusal's message."""
        if self.run_id is not None and self._experiment_id is None:
            return f"the experiment of run {self.run_id}"  # a run gradtrack did not start
        known = f" (id {self._experiment_id})" if self._experiment_id else ""
        return f"experiment {self.options.experiment!r}{known}"

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
