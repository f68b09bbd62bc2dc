"""MLflow sink: batched metrics, histogram files, alert tags — and nothing lost to a bad server.

Steps wait in a bounded buffer and go out as `log-batch` requests of several steps, at most
every ``send_every_s`` unless a request is full; when the server is unreachable they stay
there, retried with backoff, and arrive in order once it is back. mlflow is imported only in
the worker thread, at the first write.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from gradtrack import lifecycle
from gradtrack.alerts import AlertEvent
from gradtrack.config import GradtrackConfig
from gradtrack.histogram_store import HistogramEntry, read_chunks, write_chunk
from gradtrack.log import logger
from gradtrack.record import StepRecord, metric_key, safe_key, scalar_metrics
from gradtrack.redact import redact
from gradtrack.sinks.base import require_module
from gradtrack.sinks.mlflow_auth import refusal_message
from gradtrack.sinks.mlflow_tracking import (
    MAX_ITEMS_PER_BATCH,
    MAX_METRICS_PER_BATCH,
    MAX_TAGS_PER_BATCH,
    PermanentError,
    Refusal,
    Tracking,
    connect,
)

HISTOGRAM_DIR = "gradtrack/histograms"
ALERTS_DIR = "gradtrack"
ALERTS_FILE = "alerts.jsonl"
LAYERS_FILE = "gradtrack/layers.json"  # layer names in depth order, for readers
PICTURES_DIR = "gradtrack/pictures"  # PNGs and report.html the MLflow UI shows
DROPPED_KEY = "gradtrack/dropped"
# With ``model_name`` (several models in one run), every artifact and tag is the model's
# own: gradtrack/<model>/histograms, gradtrack/<model>/alerts.jsonl, gradtrack.<model>.*.


def artifact_path(path: str, model_name: str | None = None) -> str:
    """An artifact path of gradtrack's, within the model's own folder when it has a name.

    >>> artifact_path(HISTOGRAM_DIR), artifact_path(HISTOGRAM_DIR, "critic")
    ('gradtrack/histograms', 'gradtrack/critic/histograms')
    """
    if not model_name:
        return path
    return f"gradtrack/{safe_key(model_name)}" + path.removeprefix("gradtrack")


def tag_key(name: str, model_name: str | None = None) -> str:
    """``gradtrack.<name>``, or ``gradtrack.<model>.<name>``.

    >>> tag_key("alert.count", "critic")
    'gradtrack.critic.alert.count'
    """
    return f"gradtrack.{safe_key(model_name)}.{name}" if model_name else f"gradtrack.{name}"


_MAX_TAG_CHARS = 5000
# An alert goes out at once unless something was sent less than this long ago; then it
# waits for the next write after that (a burst of alerts — several rules tripping at one
# step, or a step per batch — becomes one request instead of one each).
_ALERT_WAIT_S = 1.0


class _Step:
    """One step's metrics and tags waiting to be sent; ``sent`` counts metrics already out;
    ``item`` is the (first) item handed to the sink that sending it completes."""

    __slots__ = ("item", "metrics", "sent", "tags")

    def __init__(
        self, metrics: list[tuple[str, float, int, int]], tags: list[tuple[str, str]], item: int
    ) -> None:
        self.metrics, self.tags, self.sent, self.item = metrics, tags, 0, item


class _Upload(NamedTuple):
    path: Path
    artifact_dir: str
    item: int | None  # the first handed item whose data the file holds (None: derived data)


class MlflowSink:
    """Logs every step to an MLflow run (the active one, or one it starts and ends)."""

    def __init__(self, config: GradtrackConfig | None = None, run_id: str | None = None) -> None:
        require_module("mlflow", "mlflow")
        self.config = config or GradtrackConfig()
        self.options = self.config.mlflow
        self.tracking_uri = self.options.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        self.run_id = run_id
        self.owns_run = False
        # The run is also MLflow's active run in the thread that made this sink (the user's).
        self.shares_run = False
        if run_id is None and "mlflow" in sys.modules:  # only then can a run be active
            import mlflow

            active = mlflow.active_run()
            if active is not None:  # captured here: MLflow's active run is per thread
                self.run_id = active.info.run_id
                self.tracking_uri = self.tracking_uri or mlflow.get_tracking_uri()
                self.shares_run = True
        # How the run ends, when gradtrack started it: FINISHED, or FAILED / KILLED when
        # training raised or was interrupted (set by the watcher before close()).
        self.outcome = "FINISHED"
        self.dropped = 0
        self.failures = 0
        self._ended = False  # gradtrack ended the run it started
        self._tracking: Tracking | None = None
        self._artifact_uri: str | None = None
        self._pending: deque[_Step] = deque()
        self._uploads: deque[_Upload] = deque()
        self._histograms: list[HistogramEntry] = []
        self._histogram_steps: set[int] = set()
        self._histograms_item: int | None = None  # the first item whose histograms wait
        self._handed = 0  # items (records and alerts) handed to this sink so far
        self._staging = Path(tempfile.mkdtemp(prefix="gradtrack-mlflow-"))
        self._model = self.config.model_name
        self._alerts_path = self._staging / ALERTS_FILE
        self._alert_count = 0
        self._first_nonfinite_logged = False
        self._reported_dropped = 0
        self._extreme_names: tuple[str, str] | None = None
        self._layers: dict[str, None] = {}  # layer names in order of first appearance
        self._retry_at = 0.0
        self._backoff_s = 0.0
        self._last_sent = -math.inf  # the first write goes out at once: the run appears
        self._alert_waiting = False
        self._outage_reported = False
        # The last request was refused (401/403, untrusted TLS): waiting fixes nothing.
        self._refused = False
        self._experiment_id: str | None = None
        # The report package draws; imported here, not at the top: it sits above the sinks.
        from gradtrack.report.live import Pictures

        self._pictures = Pictures(self.options.pictures, self.options.pictures_every)
        if run_id is None and self.run_id is None and self.config.mlflow.share_run:
            self._start_shared_run()
        if self.shares_run and not self.owns_run:
            logger.info("%s", self._where())

    def _start_shared_run(self) -> None:
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
            self._start_run(self._connection())
            mlflow.start_run(run_id=self.run_id)
        except Exception as exc:
            _warn(
                f"gradtrack could not start its MLflow run now ({exc!r}); it starts it at "
                "its first write, and your own mlflow.* calls go to a run of their own"
            )
            return
        self.shares_run = True
        # MLflow's own exit hook (registered when mlflow was imported) ends the active run
        # FINISHED; ours, registered after it, runs first: the run ends as training ended.
        atexit.unregister(_close_watchers_before_mlflow_exits)
        atexit.register(_close_watchers_before_mlflow_exits)
        logger.info("%s", self._where())

    def _where(self) -> str:
        """One line: which run, and how to look at it."""
        uri = self.tracking_uri or ""
        look = (
            f"open {uri}" if uri.startswith(("http://", "https://"))
            else f"look with: mlflow ui --backend-store-uri {uri}"
        )  # fmt: skip
        own = "your active run" if not self.owns_run else "started by gradtrack"
        shared = "; your own mlflow.log_* calls land in it too" if self.shares_run else ""
        return redact(f"MLflow run {self.run_id} ({own}{shared}) at {uri}; {look}")

    def report_command(self) -> str | None:
        """The command that draws this run's gradient-flow report (the watcher logs it)."""
        if self.run_id is None:
            return None
        return f"gradtrack report {self.run_id} --tracking-uri {_portable_uri(self.tracking_uri)}"

    def end_shared_run(self) -> None:
        """Called by the watcher's close in the thread that made the sink: the run gradtrack
        started stops being MLflow's active run there, so the user's next ``mlflow.start_run``
        (or the next ``watch``) starts a new run instead of writing into this one. A run
        gradtrack ended is ended there the fluent way; one still owed steps (a close that
        timed out, a spool left for ``gradtrack sync``) keeps its status and is only let go."""
        if not (self.shares_run and self.owns_run):
            return
        import mlflow

        active = mlflow.active_run()
        if active is None or active.info.run_id != self.run_id:
            return  # the user ended it, or started another on top
        if self._ended:
            mlflow.end_run(self.outcome)
            return
        # MLflow's only public way out, end_run, also marks the run ended (with its client's
        # minutes-long retries when the server is away): take it off this thread's stack of
        # active runs instead (mlflow.tracking.fluent, checked with mlflow 3.17).
        from mlflow.tracking import fluent

        stack = fluent._active_run_stack.get()
        if stack and stack[-1].info.run_id == self.run_id:
            stack.pop()

    # -- GradientSink ----------------------------------------------------------------------
    def write(self, batch: Sequence[StepRecord]) -> None:
        for record in batch:
            self._handed += 1
            self._buffer(record)
        if self._pictures.add(batch):
            self._draw_pictures()
        if self._send_due():
            self._pump(until=None)

    def alert(self, event: AlertEvent) -> None:
        self._handed += 1
        item = self._handed
        self._pictures.alert(event)
        self._alert_count += 1
        with self._alerts_path.open("a") as alerts:
            alerts.write(event.model_dump_json() + "\n")
        model = self._model
        tags = [
            (tag_key("alert.count", model), str(self._alert_count)),
            (tag_key("alert.last", model), f"step {event.step}: {event.message}"[:_MAX_TAG_CHARS]),
        ]
        if event.rule == "nonfinite" and not self._first_nonfinite_logged:
            self._first_nonfinite_logged = True
            tags += [
                (tag_key("first_nonfinite_step", model), str(event.step)),
                (tag_key("first_nonfinite_layer", model), event.origin_layer or ""),
                (tag_key("first_nonfinite_stage", model), event.origin_stage or ""),
            ]
        last = self._pending[-1] if self._pending else None
        if last is not None and not last.metrics and last.sent == 0:
            last.tags = list({**dict(last.tags), **dict(tags)}.items())  # a burst: one request
        else:
            self._pending.append(_Step([], tags, item))
        self._queue_upload(self._alerts_path, artifact_path(ALERTS_DIR, model), item)
        self._alert_waiting = True
        if self._send_due():
            self._pump(until=None)

    def delivered(self) -> int:
        """How many of the items handed to this sink MLflow has — metrics, tags and the
        files holding their histograms and alerts —, every one up to that count."""
        waiting = [upload.item for upload in self._uploads if upload.item is not None]
        if self._pending:
            waiting.append(self._pending[0].item)
        if self._histograms_item is not None:
            waiting.append(self._histograms_item)
        return min(waiting) - 1 if waiting else self._handed

    def spool_target(self) -> dict[str, Any]:
        """How `gradtrack sync` reaches this run again; never a credential (MLflow's client
        takes those from MLFLOW_TRACKING_USERNAME/PASSWORD or _TOKEN)."""
        return {
            "backend": "mlflow",
            "tracking_uri": _portable_uri(self.tracking_uri),
            "run_id": self.run_id,
            "owns_run": self.owns_run,
            "model_name": self._model,
            "options": self.options.model_dump(mode="json", exclude={"tracking_uri"}),
            "cwd": os.getcwd(),  # where MLflow's default store is, if none was named
        }

    @classmethod
    def from_spool_target(
        cls, target: dict[str, Any], outcome: str = "FINISHED", flush_timeout_s: float = 300.0
    ) -> MlflowSink:
        """The sink `gradtrack sync` delivers a spool's items with: the same run (or, if
        it was never created, a new one)."""
        options = {**target.get("options", {}), "tracking_uri": target.get("tracking_uri")}
        options["share_run"] = False  # no user's thread to share a run with
        if options["tracking_uri"] is None and target.get("cwd"):
            os.chdir(target["cwd"])  # MLflow's default store is relative to the folder
        config = GradtrackConfig(
            mlflow=options, model_name=target.get("model_name"), flush_timeout_s=flush_timeout_s
        )
        sink = cls(config, run_id=target.get("run_id"))
        sink.owns_run = bool(target.get("owns_run")) or target.get("run_id") is None
        sink.outcome = outcome
        # Alerts from before the resumption stay in their own file (readers take them all).
        sink._alerts_path = sink._staging / f"alerts-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
        return sink

    def retry(self) -> None:
        """Send what is due (respecting the backoff of an outage): the courier's nudge while
        the tracker owes it confirmations."""
        if self._send_due() or (self._uploads and not self._pending):
            self._pump(until=None)

    def flush(self) -> None:
        """Send everything now; during an outage, try once and leave the rest buffered."""
        self._write_histogram_chunk()
        self._retry_at = min(self._retry_at, time.monotonic())
        self._pump(until=None)

    def close(self) -> None:
        self._write_histogram_chunk()
        # Retry within the watcher's own close timeout, with room left to end the run.
        # A refusal is not fixed by waiting: the spool keeps the steps.
        deadline = time.monotonic() + (0.0 if self._refused else 0.8 * self.config.flush_timeout_s)
        self._pump(until=deadline)
        # Pictures only once the data is out: they must never delay or displace it.
        if not self._pending and self._pictures.due_at_close():
            self._draw_pictures()
            self._pump(until=deadline)
        if self.owns_run and self.run_id is not None and not self._pending:
            try:
                self._connection().end_run(self.run_id, self.outcome)
                self._ended = True
            except Exception as exc:
                _warn(f"gradtrack could not end MLflow run {self.run_id}: {exc!r}")
        if self._pending or self._uploads:
            _warn(
                f"gradtrack's MLflow sink closes with {len(self._pending)} steps and "
                f"{len(self._uploads)} file(s) not delivered ({self.tracking_uri}); "
                f"kept files: {self._staging}"
            )
        else:
            shutil.rmtree(self._staging, ignore_errors=True)
        if self._tracking is not None:
            self._tracking.close()  # e.g. the embedded store's database connections

    # -- buffering -------------------------------------------------------------------------
    def _buffer(self, record: StepRecord) -> None:
        new = [layer for layer in record.layers if layer not in self._layers]
        if new:
            self._layers.update(dict.fromkeys(new))
            path = self._staging / Path(LAYERS_FILE).name
            path.write_text(json.dumps(list(self._layers)))
            self._queue_upload(
                path, Path(artifact_path(LAYERS_FILE, self._model)).parent.as_posix(), None
            )
        timestamp = int(record.wall_time * 1000)
        tags = self._extreme_tags(record)
        while len(self._pending) >= self.options.max_buffered_steps:
            self._pending.popleft()
            self.dropped += 1
            if self.dropped == 1:
                _warn(
                    f"gradtrack's MLflow buffer is full ({self.options.max_buffered_steps} steps):"
                    " dropping the oldest; the count is logged as gradtrack/dropped"
                )
        values = scalar_metrics(record)
        dropped_key = metric_key("gradtrack", "dropped", self._model)
        values.pop(dropped_key, None)  # one count: those lost upstream and in this buffer
        dropped = record.dropped_steps + self.dropped
        if dropped != self._reported_dropped:
            self._reported_dropped = dropped
            values[dropped_key] = float(dropped)
        metrics = [(key, value, timestamp, record.step) for key, value in values.items()]
        self._pending.append(_Step(metrics, tags, self._handed))
        if record.histograms and self._histograms_item is None:
            self._histograms_item = self._handed
        for layer, histogram in record.histograms.items():
            self._histograms.append((record.step, layer, histogram))
            self._histogram_steps.add(record.step)
        if len(self._histogram_steps) >= self.options.hist_chunk_steps:
            self._write_histogram_chunk()

    def _extreme_tags(self, record: StepRecord) -> list[tuple[str, str]]:
        extremes = record.extreme_layers()
        names = None if extremes is None else (extremes[0][0], extremes[1][0])
        if names is None or names == self._extreme_names:
            return []
        self._extreme_names = names
        model = self._model
        return [
            (tag_key("weakest_layer", model), names[0]),
            (tag_key("strongest_layer", model), names[1]),
        ]

    def _write_histogram_chunk(self) -> None:
        if not self._histograms:
            return
        path = write_chunk(self._staging, self._histograms)
        self._histograms, self._histogram_steps = [], set()
        self._queue_upload(path, artifact_path(HISTOGRAM_DIR, self._model), self._histograms_item)
        self._histograms_item = None

    def _draw_pictures(self) -> None:
        name = self.options.run_name or self.run_id or "gradtrack run"
        source = f"MLflow run {self.run_id} ({self.tracking_uri})"
        for path in self._pictures.draw(self._staging / "pictures", name, source):
            self._queue_upload(path, artifact_path(PICTURES_DIR, self._model), None)

    def _queue_upload(self, path: Path, artifact_dir: str, item: int | None) -> None:
        """Upload ``path`` (once, however often it changes before it goes out)."""
        for i, queued in enumerate(self._uploads):
            if (queued.path, queued.artifact_dir) == (path, artifact_dir):
                if queued.item is None:
                    self._uploads[i] = queued._replace(item=item)
                return
        self._uploads.append(_Upload(path, artifact_dir, item))

    # -- sending ---------------------------------------------------------------------------
    def _send_due(self) -> bool:
        """``send_every_s`` has passed since the last send (an alert waits at most
        ``_ALERT_WAIT_S``), or a full request is waiting."""
        since = time.monotonic() - self._last_sent
        if since >= self.options.send_every_s or (self._alert_waiting and since >= _ALERT_WAIT_S):
            return True
        unsent = 0
        for step in self._pending:
            unsent += len(step.metrics) - step.sent
            if unsent >= MAX_METRICS_PER_BATCH:
                return True
        return False

    def _pump(self, until: float | None) -> None:
        """Send what is buffered; on failure back off, and wait it out only until ``until``."""
        self._alert_waiting = False
        try:
            while self._pending or self._uploads:
                wait = self._retry_at - time.monotonic()
                if wait > 0:
                    if until is None or time.monotonic() + wait > until:
                        return
                    time.sleep(wait)
                try:
                    self._send_next()
                except PermanentError as exc:
                    _warn(f"MLflow refused {self._head()} from gradtrack, dropped: {exc}")
                    self._drop_head()
                except Exception as exc:  # unreachable, timed out, 5xx: keep it and retry
                    self._fail(exc)
                else:
                    self._recovered()
        finally:
            self._last_sent = time.monotonic()

    def _send_next(self) -> None:
        tracking = self._connection()
        if self.run_id is None:
            self._start_run(tracking)
            logger.info("%s", self._where())
        assert self.run_id is not None
        if self._pending:
            metrics, tags, plan = self._next_request()
            tracking.log_batch(self.run_id, metrics, tags)
            for step, sent_metrics, done in plan:
                step.sent += sent_metrics
                if done:
                    self._pending.popleft()
            return
        path, artifact_dir, _ = self._uploads[0]
        if self._artifact_uri is None:
            self._artifact_uri = tracking.artifact_uri(self.run_id)
        tracking.log_artifact(self.run_id, self._artifact_uri, path, artifact_dir)
        self._uploads.popleft()

    def _next_request(
        self,
    ) -> tuple[list[Any], list[tuple[str, str]], list[tuple[_Step, int, bool]]]:
        """Metrics and tags of the oldest steps, within MLflow's per-request limits; the plan
        says how many metrics of which step go out and whether that finishes the step."""
        metrics: list[tuple[str, float, int, int]] = []
        tags: list[tuple[str, str]] = []
        plan: list[tuple[_Step, int, bool]] = []
        for step in self._pending:
            step_tags = step.tags if step.sent == 0 else []  # tags go with a step's first part
            room = MAX_ITEMS_PER_BATCH - len(metrics) - len(tags) - len(step_tags)
            if plan and (len(tags) + len(step_tags) > MAX_TAGS_PER_BATCH or room <= 0):
                break
            take = step.metrics[step.sent : step.sent + min(room, MAX_METRICS_PER_BATCH)]
            metrics.extend(take)
            tags.extend(step_tags)
            done = step.sent + len(take) == len(step.metrics)
            plan.append((step, len(take), done))
            if not done:
                break
        return metrics, tags, plan

    def _head(self) -> str:
        """What `_drop_head` drops, in words."""
        if self._pending:
            metrics = self._pending[0].metrics
            return f"the metrics of step {metrics[0][3]}" if metrics else "a batch of alert tags"
        return f"the file {self._uploads[0].path.name}" if self._uploads else "nothing"

    def _drop_head(self) -> None:
        if self._pending:
            self._pending.popleft()
            self.dropped += 1
        elif self._uploads:
            self._uploads.popleft()

    def _connection(self) -> Tracking:
        if self._tracking is None:
            if self.tracking_uri is None:
                import mlflow

                self.tracking_uri = mlflow.get_tracking_uri()
            self._tracking = connect(self.tracking_uri, self.options.request_timeout_s)
        return self._tracking

    def _start_run(self, tracking: Tracking) -> None:
        self._experiment_id = tracking.experiment_id(self.options.experiment)
        self.run_id, self._artifact_uri = tracking.create_run(
            self._experiment_id, self.options.run_name
        )
        self.owns_run = True

    def _fail(self, error: Exception) -> None:
        self.failures += 1
        self._backoff_s = min(self.options.retry_max_s, max(0.5, self._backoff_s * 2))
        self._retry_at = time.monotonic() + self._backoff_s
        self._refused = isinstance(error, Refusal)
        if not self._outage_reported:
            self._outage_reported = True
            if isinstance(error, Refusal):
                _warn(refusal_message(error, self.tracking_uri, self._experiment()))
            else:
                _warn(
                    f"gradtrack cannot reach MLflow at {self.tracking_uri} ({error!r}); steps "
                    "wait (in the run's spool) and are retried with backoff"
                )

    def _experiment(self) -> str:
        """The experiment the run is in, in words, for a refusal's message."""
        if self.run_id is not None and self._experiment_id is None:
            return f"the experiment of run {self.run_id}"  # a run gradtrack did not start
        known = f" (id {self._experiment_id})" if self._experiment_id else ""
        return f"experiment {self.options.experiment!r}{known}"

    def _recovered(self) -> None:
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self._outage_reported = False
        self._refused = False


def _close_watchers_before_mlflow_exits() -> None:
    lifecycle.close_open_watchers()


def read_histograms(
    run_id: str, tracking_uri: str | None = None, model_name: str | None = None
) -> dict[str, list[tuple[int, Any]]]:
    """Load the histograms gradtrack stored in an MLflow run: ``{layer: [(step, Histogram)]}``.

    >>> read_histograms  # doctest: +ELLIPSIS
    <function read_histograms at ...>
    """
    require_module("mlflow", "mlflow")
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    client = MlflowClient(tracking_uri)
    folder = artifact_path(HISTOGRAM_DIR, model_name)
    parent = folder.rpartition("/")[0]
    if not any(f.path == folder for f in client.list_artifacts(run_id, parent)):
        return {}
    with tempfile.TemporaryDirectory() as directory:
        local = download_artifacts(
            run_id=run_id, artifact_path=folder, dst_path=directory,
            tracking_uri=tracking_uri,
        )  # fmt: skip
        return read_chunks(Path(local).glob("hist-*.npz"))


def read_alerts(
    run_id: str, tracking_uri: str | None = None, model_name: str | None = None
) -> list[AlertEvent]:
    """The alert events gradtrack stored in an MLflow run's ``gradtrack/alerts.jsonl`` (and
    the ``alerts-<time>.jsonl`` of a delivery `gradtrack sync` resumed), in step order."""
    require_module("mlflow", "mlflow")
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    client = MlflowClient(tracking_uri)
    folder = artifact_path(ALERTS_DIR, model_name)
    names = sorted(
        f.path
        for f in client.list_artifacts(run_id, folder)
        if Path(f.path).name.startswith("alerts") and f.path.endswith(".jsonl")
    )
    events: list[AlertEvent] = []
    with tempfile.TemporaryDirectory() as directory:
        for name in names:
            local = download_artifacts(
                run_id=run_id, artifact_path=name, dst_path=directory, tracking_uri=tracking_uri
            )
            lines = Path(local).read_text().splitlines()
            # A resumed delivery may repeat the last alerts another file already holds.
            seen = {event.model_dump_json() for event in events}
            fresh = [AlertEvent.model_validate(json.loads(line)) for line in lines if line]
            events += [event for event in fresh if event.model_dump_json() not in seen]
    return sorted(events, key=lambda event: event.step)


def _portable_uri(uri: str | None) -> str | None:
    """``uri`` as another process in another folder can use it: credentials dropped (MLflow
    takes them from its variables), a relative sqlite or file store made absolute.

    >>> _portable_uri("http://alice:pw@mlflow.example:5000")
    'http://mlflow.example:5000'
    >>> _portable_uri("sqlite:////data/mlflow.db")
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


def _warn(message: str) -> None:
    # Called on the worker thread: a warning turned into an error must not stop the sink.
    try:
        warnings.warn(redact(message), RuntimeWarning, stacklevel=3)
    except Exception:
        pass
