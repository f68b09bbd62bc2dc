"""MLflow sink: batched metrics, histogram files, alert tags — and nothing lost to a bad server.

Steps wait in a bounded buffer and go out as `log-batch` requests of several steps, at most
every ``send_every_s`` unless a request is full; when the server is unreachable they stay
there, retried with backoff, and arrive in order once it is back. mlflow is imported only in
the worker thread, at the first write.

Its collaborators: `mlflow_run` (which run, its start and end), `mlflow_outbox` (what is
owed), `mlflow_sender` (sending and backoff), `mlflow_histograms` (chunk files); the names
it writes are in `gradtrack.formats.mlflow`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradtrack.alerts import AlertEvent
from gradtrack.config import GradtrackConfig
from gradtrack.extras import require_module
from gradtrack.formats.keys import metric_key
from gradtrack.formats.metrics import scalar_metrics
from gradtrack.formats.mlflow import (
    ALERTS_DIR,
    ALERTS_FILE,
    HISTOGRAM_DIR,
    LAYERS_FILE,
    PICTURES_DIR,
    artifact_path,
    tag_key,
)
from gradtrack.log import warn
from gradtrack.record import StepRecord
from gradtrack.redact import redact
from gradtrack.sinks.mlflow_histograms import HistogramChunks
from gradtrack.sinks.mlflow_outbox import Outbox
from gradtrack.sinks.mlflow_run import MlflowRun, portable_uri
from gradtrack.sinks.mlflow_sender import Sender
from gradtrack.sinks.runbook import RunBook

_MAX_TAG_CHARS = 5000


class MlflowSink:
    """Logs every step to an MLflow run (the active one, or one it starts and ends)."""

    def __init__(self, config: GradtrackConfig | None = None, run_id: str | None = None) -> None:
        require_module("mlflow", "mlflow")
        self.config = config or GradtrackConfig()
        self.options = self.config.mlflow
        self._run = MlflowRun(self.options, run_id)
        # How the run ends, when gradtrack started it: FINISHED, or FAILED / KILLED when
        # training raised or was interrupted (set by the watcher before close()).
        self.outcome = "FINISHED"
        self._outbox = Outbox(self.options.max_buffered_steps)
        self._sender = Sender(self.options, self._run, self._outbox)
        self._histograms = HistogramChunks(self.options.hist_chunk_steps)
        self._book = RunBook()
        self._handed = 0  # items (records and alerts) handed to this sink so far
        self._staging = Path(tempfile.mkdtemp(prefix="gradtrack-mlflow-"))
        self._model = self.config.model_name
        self._alerts_path = self._staging / ALERTS_FILE
        self._alert_count = 0
        self._reported_dropped = 0
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

    @property
    def dropped(self) -> int:
        """Steps dropped: from a full buffer, or refused by MLflow."""
        return self._outbox.dropped

    @property
    def failures(self) -> int:
        """Requests that failed and were kept to retry."""
        return self._sender.failures

    def report_command(self) -> str | None:
        """The command that draws this run's gradient-flow report (the watcher logs it)."""
        if self.run_id is None:
            return None
        return f"gradtrack report {self.run_id} --tracking-uri {portable_uri(self.tracking_uri)}"

    def end_shared_run(self) -> None:
        """Called by the watcher's close in the thread that made the sink (see
        `MlflowRun.end_shared`)."""
        self._run.end_shared(self.outcome)

    # -- GradientSink ----------------------------------------------------------------------
    def write(self, batch: Sequence[StepRecord]) -> None:
        for record in batch:
            self._handed += 1
            self._buffer(record)
        if self._pictures.add(batch):
            self._draw_pictures()
        if self._sender.due():
            self._sender.pump(until=None)

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
        first = self._book.first_nonfinite(event)
        tags += [(tag_key(name, model), str(value)) for name, value in first.items()]
        self._outbox.add_tags(tags, item)
        self._outbox.add_upload(self._alerts_path, artifact_path(ALERTS_DIR, model), item)
        self._sender.alert_waiting = True
        if self._sender.due():
            self._sender.pump(until=None)

    def delivered(self) -> int:
        """How many of the items handed to this sink MLflow has — metrics, tags and the
        files holding their histograms and alerts —, every one up to that count."""
        waiting = self._outbox.waiting_items()
        if self._histograms.item is not None:
            waiting.append(self._histograms.item)
        return min(waiting) - 1 if waiting else self._handed

    def spool_target(self) -> dict[str, Any]:
        """How `gradtrack sync` reaches this run again; never a credential (MLflow's client
        takes those from MLFLOW_TRACKING_USERNAME/PASSWORD or _TOKEN)."""
        return {
            "backend": "mlflow",
            "tracking_uri": portable_uri(self.tracking_uri),
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
        sink._run.owns_run = bool(target.get("owns_run")) or target.get("run_id") is None
        sink.outcome = outcome
        # Alerts from before the resumption stay in their own file (readers take them all).
        sink._alerts_path = sink._staging / f"alerts-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
        return sink

    def retry(self) -> None:
        """Send what is due (respecting the backoff of an outage): the courier's nudge while
        the tracker owes it confirmations."""
        if self._sender.due() or (self._outbox.uploads and not self._outbox.steps):
            self._sender.pump(until=None)

    def flush(self) -> None:
        """Send everything now; during an outage, try once and leave the rest buffered."""
        self._write_histogram_chunk()
        self._sender.retry_now()
        self._sender.pump(until=None)

    def close(self) -> None:
        self._write_histogram_chunk()
        # Retry within the watcher's own close timeout, with room left to end the run.
        # A refusal is not fixed by waiting: the spool keeps the steps.
        wait_s = 0.0 if self._sender.refused else 0.8 * self.config.flush_timeout_s
        deadline = time.monotonic() + wait_s
        self._sender.pump(until=deadline)
        # Pictures only once the data is out: they must never delay or displace it.
        if not self._outbox.steps and self._pictures.due_at_close():
            self._draw_pictures()
            self._sender.pump(until=deadline)
        if not self._outbox.steps:
            self._run.end(self.outcome)
        if self._outbox.steps or self._outbox.uploads:
            warn(
                redact(
                    f"gradtrack's MLflow sink closes with {len(self._outbox.steps)} steps and "
                    f"{len(self._outbox.uploads)} file(s) not delivered ({self.tracking_uri}); "
                    f"kept files: {self._staging}"
                )
            )
        else:
            shutil.rmtree(self._staging, ignore_errors=True)
        self._run.close()

    # -- buffering -------------------------------------------------------------------------
    def _buffer(self, record: StepRecord) -> None:
        if self._book.add_layers(record.layers):
            path = self._staging / Path(LAYERS_FILE).name
            path.write_text(json.dumps(self._book.layers))
            self._outbox.add_upload(
                path, Path(artifact_path(LAYERS_FILE, self._model)).parent.as_posix(), None
            )
        timestamp = int(record.wall_time * 1000)
        model = self._model
        tags = [
            (tag_key(name, model), value) for name, value in self._book.extremes(record).items()
        ]
        self._outbox.make_room()
        values = scalar_metrics(record)
        dropped_key = metric_key("gradtrack", "dropped", model)
        values.pop(dropped_key, None)  # one count: those lost upstream and in this buffer
        dropped = record.dropped_steps + self.dropped
        if dropped != self._reported_dropped:
            self._reported_dropped = dropped
            values[dropped_key] = float(dropped)
        metrics = [(key, value, timestamp, record.step) for key, value in values.items()]
        self._outbox.add_step(metrics, tags, self._handed)
        if self._histograms.add(record, self._handed):
            self._write_histogram_chunk()

    def _write_histogram_chunk(self) -> None:
        written = self._histograms.write(self._staging)
        if written is not None:
            path, item = written
            self._outbox.add_upload(path, artifact_path(HISTOGRAM_DIR, self._model), item)

    def _draw_pictures(self) -> None:
        name = self.options.run_name or self.run_id or "gradtrack run"
        source = f"MLflow run {self.run_id} ({self.tracking_uri})"
        for path in self._pictures.draw(self._staging / "pictures", name, source):
            self._outbox.add_upload(path, artifact_path(PICTURES_DIR, self._model), None)
