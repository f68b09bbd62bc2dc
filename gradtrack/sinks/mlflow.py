"""MLflow sink: batched metrics, histogram files, alert tags — each batch stored before
`send` returns.

It is a `TrackerSink`: its courier hands it batches from the run's spool and retries one that
failed; the sink itself keeps no backlog. A batch becomes `log-batch` requests (as many steps
per request as MLflow's limits allow) and the files it names (layer list, alerts); a batch
sent again after a failure resumes at the request that failed. Histograms go per
``hist_chunk_steps`` histogram steps (or ``hist_chunk_s``) as one chunk file, on a cursor of
their own. mlflow is imported only on the courier's thread, at the first send.

Here: the sink, and the requests a batch becomes (`pack`: `log-batch` calls within MLflow's
per-request limits, then the files to upload, in the order they must reach the run). Which
run, and the calls that reach it: `gradtrack.sinks.mlflow_tracking`; the names it writes:
`gradtrack.formats.mlflow`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradtrack.config import GradtrackConfig
from gradtrack.errors import require_module
from gradtrack.formats import write_atomic
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.flight import FLIGHT_DIR, FlightWindow
from gradtrack.formats.histogram import write_chunk
from gradtrack.formats.metrics import metric_key, scalar_metrics, window_series
from gradtrack.formats.mlflow import (
    ALERTS_DIR,
    ALERTS_FILE,
    HISTOGRAM_DIR,
    LAYERS_FILE,
    PICTURES_DIR,
    artifact_path,
    tag_key,
)
from gradtrack.formats.record import StepRecord
from gradtrack.log import report
from gradtrack.sinks.base import RunBook, TrackerSink
from gradtrack.sinks.mlflow_tracking import (
    MlflowRun,
    PermanentError,
    Refusal,
    portable_uri,
    refusal_message,
)

_MAX_TAG_CHARS = 5000
# Request limits of MLflow's log-batch endpoint (mlflow/utils/validation.py).
MAX_METRICS_PER_BATCH = 1000
MAX_TAGS_PER_BATCH = 100
MAX_ITEMS_PER_BATCH = 1000

Metric = tuple[str, float, int, int]  # key, value, timestamp (ms), step
Tag = tuple[str, str]


@dataclass
class LogBatch:
    metrics: list[Metric] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)  # one value per key: the last

    def room(self) -> int:
        return min(
            MAX_METRICS_PER_BATCH - len(self.metrics),
            MAX_ITEMS_PER_BATCH - len(self.metrics) - len(self.tags),
        )


@dataclass(frozen=True)
class Upload:
    path: Path
    artifact_dir: str


Request = LogBatch | Upload


def pack(steps: Iterable[tuple[list[Metric], list[Tag]]]) -> list[LogBatch]:
    """Each step's metrics and tags, in order, into as few `log-batch` requests as the
    limits allow (a step larger than one request spans several; its tags go with its
    first part). Tags of one key keep their last value."""
    requests = [LogBatch()]
    for metrics, tags in steps:
        for key, value in tags:
            current = requests[-1]
            full = len(current.tags) >= MAX_TAGS_PER_BATCH or current.room() <= 0
            if full and key not in current.tags:
                requests.append(current := LogBatch())
            current.tags[key] = value
        while metrics:
            current = requests[-1]
            room = current.room()
            if room <= 0:
                requests.append(current := LogBatch())
                room = current.room()
            current.metrics.extend(metrics[:room])
            metrics = metrics[room:]
    return [request for request in requests if request.metrics or request.tags]


class _Sending:
    """A batch's requests not yet done (a failed send resumes here)."""

    def __init__(self, batch: Sequence[Any], requests: list[Request]) -> None:
        self.batch, self.requests = batch, requests


class MlflowSink(TrackerSink):
    """Logs every step to an MLflow run (the active one, or one it starts and ends)."""

    def __init__(self, config: GradtrackConfig | None = None, run_id: str | None = None) -> None:
        require_module("mlflow", "mlflow")
        self.config = config or GradtrackConfig()
        self.options = self.config.mlflow
        self.gather_s = self.options.send_every_s
        self.histogram_steps = self.options.hist_chunk_steps
        self.histogram_wait_s = self.options.hist_chunk_s
        self.retry_max_s = self.options.retry_max_s
        self._run = MlflowRun(self.options, run_id)
        self.outcome = "FINISHED"
        self.rejected = 0  # requests MLflow refused for what they held (dropped, warned)
        self._book = RunBook()
        self._staging = Path(tempfile.mkdtemp(prefix="gradtrack-mlflow-"))
        self._model = self.config.model_name
        self._alerts_path = self._staging / ALERTS_FILE
        self._alert_count = 0
        self._reported_dropped = 0
        self._sending: _Sending | None = None
        self._sending_histograms: _Sending | None = None
        # The report package draws; imported here, not at the top: it sits above the sinks.
        from gradtrack.report.live import Pictures

        self._pictures = Pictures(self.options.pictures, self.options.pictures_every)
        self._run.begin(run_id)

    @property
    def run_id(self) -> str | None:
        return self._run.run_id

    @property
    def tracking_uri(self) -> str | None:
        return self._run.tracking_uri

    @property
    def owns_run(self) -> bool:
        """gradtrack started the run (and ends it)."""
        return self._run.owns_run

    @property
    def shares_run(self) -> bool:
        """The run is also MLflow's active run in the thread that made this sink."""
        return self._run.shares_run

    def report_command(self) -> str | None:
        """The command that draws this run's gradient-flow report (the watcher logs it)."""
        if self.run_id is None:
            return None
        return f"gradtrack report {self.run_id} --tracking-uri {portable_uri(self.tracking_uri)}"

    def end_shared_run(self) -> None:
        """Called by the watcher's close in the thread that made the sink (see
        `MlflowRun.end_shared`)."""
        self._run.end_shared(self.outcome)

    def spool_target(self) -> dict[str, Any]:
        """How `gradtrack sync` reaches this run again; never a credential (MLflow's client
        takes those from MLFLOW_TRACKING_USERNAME/PASSWORD or _TOKEN)."""
        return {
            "backend": "mlflow",
            "tracking_uri": portable_uri(self.tracking_uri),
            "run_id": self.run_id,
            "owns_run": self.owns_run,
            "ended": self._run.ended,
            "model_name": self._model,
            "options": self.options.model_dump(mode="json", exclude={"tracking_uri"}),
            "cwd": os.getcwd(),  # where MLflow's default store is, if none was named
        }

    def recipe(self) -> dict[str, Any]:
        """This sink for a worker process (`in_worker_process`): its own config (secrets
        included: it goes through a pipe, never to disk), the run and where it is."""
        return {
            "backend": "mlflow",
            "config": self.config,
            "tracking_uri": self.tracking_uri,
            "run_id": self.run_id,
            "owns_run": self.owns_run,
        }

    def adopt(self, target: dict[str, Any]) -> None:
        """Follow the worker process's copy: the run it started, and whether it ended it."""
        self._run.adopt(target)

    # -- TrackerSink -----------------------------------------------------------------------
    def open(self) -> None:
        """Connect (mlflow imported, the store created) and start the run if there is none."""
        self._run.connection()
        self._run.started()

    def send(self, batch: Sequence[StepRecord | AlertEvent]) -> None:
        """Store the batch's metrics, tags and files in the run; raise if MLflow could not
        take a request (sending the same batch again resumes there)."""
        if self._sending is None or self._sending.batch is not batch:
            self._sending = _Sending(batch, self._requests(batch))
        self._perform(self._sending)
        self._sending = None

    def send_histograms(self, records: Sequence[StepRecord]) -> None:
        """One chunk file with these records' histograms, uploaded."""
        sending = self._sending_histograms
        if sending is None or sending.batch is not records:
            entries = [
                (record.step, layer, histogram)
                for record in records
                for layer, histogram in record.histograms.items()
            ]
            requests: list[Request] = []
            if entries:
                path = write_chunk(self._staging, entries)
                requests.append(Upload(path, artifact_path(HISTOGRAM_DIR, self._model)))
            self._sending_histograms = sending = _Sending(records, requests)
        self._perform(sending)
        self._sending_histograms = None

    def waiting_helps(self, error: Exception) -> bool:
        return not isinstance(error, Refusal)

    def failure_message(self, error: Exception) -> str:
        uri = self._run.tracking_uri
        if isinstance(error, Refusal):
            return refusal_message(error, uri, self._run.experiment())
        return (
            f"gradtrack cannot reach MLflow at {uri} ({error!r}); steps wait (in the run's "
            "spool) and are retried with backoff"
        )

    def end(self, complete: bool) -> None:
        """With every item delivered: the pictures, then a run gradtrack started is ended
        with the run's outcome. Otherwise the run is left as it is, for `gradtrack sync`."""
        try:
            if complete and self._pictures.due_at_close():
                self._draw_pictures()
                if self._sending is not None:
                    self._perform(self._sending)
            if complete:
                self._run.end(self.outcome)
        except Exception as exc:
            report(f"gradtrack could not finish its MLflow run {self.run_id}: {exc!r}")
        finally:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._run.close()

    # -- requests --------------------------------------------------------------------------
    def _perform(self, sending: _Sending) -> None:
        tracking = self._run.connection()
        run_id = self._run.started()
        while sending.requests:
            request = sending.requests[0]
            try:
                if isinstance(request, LogBatch):
                    tracking.log_batch(run_id, request.metrics, list(request.tags.items()))
                else:
                    if self._run.artifact_uri is None:
                        self._run.artifact_uri = tracking.artifact_uri(run_id)
                    tracking.log_artifact(
                        run_id, self._run.artifact_uri, request.path, request.artifact_dir
                    )
            except PermanentError as exc:
                self.rejected += 1
                report(f"MLflow refused a request of gradtrack's, dropped: {exc}")
            sending.requests.pop(0)

    def _requests(self, batch: Sequence[StepRecord | AlertEvent]) -> list[Request]:
        steps: list[tuple[list[Metric], list[Tag]]] = []
        uploads: list[Upload] = []
        records = [item for item in batch if isinstance(item, StepRecord)]
        for item in batch:
            if isinstance(item, StepRecord):
                steps.append(self._step(item, uploads))
            else:
                steps.append(([], self._alert(item, uploads)))
        if self._pictures.add(records):
            self._draw_pictures(uploads)
        unique = list(dict.fromkeys(uploads))  # a file changed twice goes once
        return [*pack(steps), *unique]

    def _step(self, record: StepRecord, uploads: list[Upload]) -> tuple[list[Metric], list[Tag]]:
        model = self._model
        if self._book.add_layers(record.layers):
            path = self._staging / Path(LAYERS_FILE).name
            # Rewritten in place whenever layers appear: an upload never reads half of it.
            write_atomic(path, json.dumps(self._book.layers), fsync=False)
            folder = Path(artifact_path(LAYERS_FILE, model)).parent.as_posix()
            uploads.append(Upload(path, folder))
        extremes = self._book.extremes(record)
        tags = [(tag_key(name, model), value) for name, value in extremes.items()]
        values = scalar_metrics(record)
        dropped_key = metric_key("gradtrack", "dropped", model)
        values.pop(dropped_key, None)  # written when the count changes
        if record.dropped_steps != self._reported_dropped:
            self._reported_dropped = record.dropped_steps
            values[dropped_key] = float(record.dropped_steps)
        timestamp = int(record.wall_time * 1000)
        metrics = [(key, value, timestamp, record.step) for key, value in values.items()]
        if record.flight is not None:
            metrics += self._flight(record.flight, timestamp, uploads)
        return metrics, tags

    def _flight(self, window: FlightWindow, timestamp: int, uploads: list[Upload]) -> list[Metric]:
        """The window's file and picture as artifacts; its steps as series unless too many
        values for MLflow's rows (``flight.series_max_values``)."""
        from gradtrack.report.live import stage_window

        folder = artifact_path(FLIGHT_DIR.as_posix(), self._model)
        staged = stage_window(window, self._staging / "flight", self.options.run_name or "")
        uploads.extend(Upload(path, folder) for path in staged)
        if window.norms.size > self.config.flight.series_max_values:
            return []
        series = window_series(window, self._model)
        return [(key, value, timestamp, step) for key, value, step in series]

    def _alert(self, event: AlertEvent, uploads: list[Upload]) -> list[Tag]:
        self._pictures.alert(event)
        self._alert_count += 1
        with self._alerts_path.open("a") as alerts:
            alerts.write(event.model_dump_json() + "\n")
        model = self._model
        tags = [
            (tag_key("alert.count", model), str(self._alert_count)),
            (tag_key("alert.last", model), f"step {event.step}: {event.message}"[:_MAX_TAG_CHARS]),
        ]
        first = self._book.first_nonfinite(event)
        tags += [(tag_key(name, model), str(value)) for name, value in first.items()]
        uploads.append(Upload(self._alerts_path, artifact_path(ALERTS_DIR, model)))
        return tags

    def _draw_pictures(self, uploads: list[Upload] | None = None) -> None:
        name = self.options.run_name or self.run_id or "gradtrack run"
        source = f"MLflow run {self.run_id} ({self.tracking_uri})"
        drawn = [
            Upload(path, artifact_path(PICTURES_DIR, self._model))
            for path in self._pictures.draw(self._staging / "pictures", name, source)
        ]
        if uploads is not None:
            uploads.extend(drawn)
        else:
            self._sending = _Sending((), list(drawn))


# -- the same sink, made again in another process ----------------------------------------------
def in_worker_process(recipe: dict[str, Any]) -> MlflowSink:
    """The copy of a training process's sink (its `MlflowSink.recipe`) that a worker process
    delivers with: the same run (started there when it was shared with the user's thread,
    else here at the first send), never MLflow's active run here."""
    config: GradtrackConfig = recipe["config"]
    options = config.mlflow.model_copy(update={"share_run": False})
    sink = MlflowSink(config.model_copy(update={"mlflow": options}), run_id=recipe["run_id"])
    sink._run.tracking_uri = recipe["tracking_uri"] or sink._run.tracking_uri
    sink._run.owns_run = bool(recipe["owns_run"]) or recipe["run_id"] is None
    return sink


def from_spool_target(
    target: dict[str, Any], outcome: str = "FINISHED", flush_timeout_s: float = 300.0
) -> MlflowSink:
    """The sink `gradtrack sync` delivers a spool's items with: the same run (or, if it was
    never created, a new one)."""
    options = {**target.get("options", {}), "tracking_uri": target.get("tracking_uri")}
    options["share_run"] = False  # no user's thread to share a run with
    if options["tracking_uri"] is None and target.get("cwd"):
        os.chdir(target["cwd"])  # MLflow's default store is relative to the folder
    config = GradtrackConfig(
        mlflow=options, model_name=target.get("model_name"), flush_timeout_s=flush_timeout_s
    )
    sink = MlflowSink(config, run_id=target.get("run_id"))
    sink._run.owns_run = bool(target.get("owns_run")) or target.get("run_id") is None
    sink.outcome = outcome
    # Alerts from before the resumption stay in their own file (readers take them all).
    sink._alerts_path = sink._staging / f"alerts-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    return sink
