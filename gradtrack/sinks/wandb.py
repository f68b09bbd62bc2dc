"""Weights & Biases sink: gradtrack's steps on their own axis, never moving the user's steps.

In a run gradtrack started, each step is a history row of its own while nobody else logs;
in any other run each step rides one of the user's rows (`gradtrack.sinks.wandb_rows`).
Charts use ``gradtrack/step`` (``define_metric``), so a step that rides a later row is still
drawn at its own step. The run is found, started and bound by `gradtrack.sinks.wandb_run`;
the names written are in `gradtrack.formats.wandb`.

wandb is imported only when the first step is written; a run already active is reused.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradtrack.alerts import AlertEvent
from gradtrack.config import GradtrackConfig
from gradtrack.errors import GradtrackError
from gradtrack.extras import require_module
from gradtrack.formats.keys import metric_key
from gradtrack.formats.metrics import scalar_metrics
from gradtrack.formats.wandb import HIST_FAMILY, LAYERS_CONFIG_KEY, PICTURES_FAMILY, PROFILE_FAMILY
from gradtrack.record import StepRecord
from gradtrack.sinks.runbook import RunBook
from gradtrack.sinks.wandb_exit import AWAITING_RUN_END, exiting, register_exit_hooks
from gradtrack.sinks.wandb_rows import RowPlacer
from gradtrack.sinks.wandb_run import WandbRun, finished

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run


class WandbSink:
    """Logs every step to W&B: metrics, histograms, a gradient-flow profile and alerts.

    In a run gradtrack started, each step is a row of its own while nobody else logs. In
    the user's run (or once someone else logs), steps ride the user's rows: the user's
    ``_step`` numbering and rows are never touched. gradtrack's metrics are plotted against
    ``gradtrack/step`` (set with ``define_metric``).
    """

    def __init__(self, config: GradtrackConfig | None = None, run: Run | None = None) -> None:
        require_module("wandb", "wandb")
        self.config = config or GradtrackConfig()
        self.options = self.config.wandb
        model = self.config.model_name
        self.step_key = metric_key("gradtrack", "step", model)
        self.coalesced_key = metric_key("gradtrack", "coalesced", model)
        self._wandb_run = WandbRun(self.config, run, self.step_key, self._on_finish)
        self._book = RunBook()
        # The report package draws; imported here, not at the top: it sits above the sinks.
        from gradtrack.report.live import Pictures

        self._pictures = Pictures(self.options.pictures, self.options.pictures_every)
        # Steps waiting for a user row, and the thread that places them.
        self._rows = RowPlacer(self.row, self.coalesced_key)
        register_exit_hooks()

    @property
    def run(self) -> Run:
        """The W&B run: the one given, else the active one, else one started now."""
        return self._wandb_run.bound()

    @property
    def coalesced(self) -> int:
        """Steps dropped for want of a user row."""
        return self._rows.coalesced

    # -- GradientSink ----------------------------------------------------------------------
    def write(self, batch: Sequence[StepRecord]) -> None:
        run = self._wandb_run.live()
        if self._rows.error is not None:
            raise GradtrackError(f"placing steps in W&B rows failed: {self._rows.error!r}")
        if self._book.add_layers(layer for record in batch for layer in record.layers):
            run.config.update({LAYERS_CONFIG_KEY: self._book.layers}, allow_val_change=True)
        if self._wandb_run.alone_in(run):
            for record in batch:
                run.log(self.row(record), commit=True)
            self._wandb_run.rows_logged(run)
        else:
            self._rows.enqueue(run, batch)
        self._rows.publish_coalesced(run)
        for name, value in self._book.extremes(batch[-1]).items():
            run.summary[f"gradtrack/{name}"] = value
        if self._pictures.add(batch):
            self._log_pictures(run)

    def alert(self, event: AlertEvent) -> None:
        from wandb.sdk.wandb_alerts import AlertLevel

        self._pictures.alert(event)
        run = self._wandb_run.live()
        levels = {"info": AlertLevel.INFO, "warning": AlertLevel.WARN, "error": AlertLevel.ERROR}
        level = levels[event.severity]
        # gradtrack's own per-rule cooldown already spaced these out; W&B's minimum wait
        # only stops it from merging distinct events that share a title.
        text = f"step {event.step}: {event.message}"
        run.alert(title=event.title, text=text, level=level, wait_duration=timedelta(seconds=1))
        for name, value in self._book.first_nonfinite(event).items():
            run.summary[f"gradtrack/{name}"] = value

    def flush(self) -> None:
        """Wait (bounded) until every waiting step rides a row, or waits for the user's next."""
        self._rows.flush(self.config.flush_timeout_s)

    def close(self) -> None:
        run = self._wandb_run.run
        if run is not None and not finished(run) and self._pictures.due_at_close():
            self._log_pictures(run)  # summary images, not rows
        self._rows.stop()
        if run is None or finished(run):
            self._rows.drop_waiting()
        elif self._wandb_run.owns_run or exiting():
            self._on_run_end()
            if self._wandb_run.owns_run:
                run.finish()
        elif self._rows.waiting():
            # The user's run goes on and may still log rows: the waiting steps wait for its
            # finish() (or the interpreter's exit) to get rows of their own.
            AWAITING_RUN_END.add(self._on_finish)
        self._rows.warn_coalesced()

    # -- the run's end ---------------------------------------------------------------------
    def _on_finish(self) -> None:
        # Called inside the user's finish() or at exit: a failure here must not break it.
        try:
            self._on_run_end()
        except Exception as error:
            warnings.warn(
                f"gradtrack could not log its last steps to the W&B run: {error!r}",
                RuntimeWarning,
                stacklevel=2,
            )

    def _on_run_end(self) -> None:
        """The run is finishing (or the interpreter exiting): nobody logs after this, so
        every waiting step can have a row of its own."""
        AWAITING_RUN_END.discard(self._on_finish)
        self._rows.stop()
        run = self._wandb_run.run
        if run is None or finished(run):
            self._rows.drop_waiting()
            self._rows.warn_coalesced()
            return
        self._rows.place_the_rest(run)
        self._rows.publish_coalesced(run)

    # -- rows and pictures -----------------------------------------------------------------
    def row(self, record: StepRecord) -> dict[str, Any]:
        """The history row for one step: metrics, histograms and, when due, the profile."""
        import wandb

        row: dict[str, Any] = {self.step_key: record.step, **scalar_metrics(record)}
        model = self.config.model_name
        for layer, histogram in record.histograms.items():
            row[metric_key(HIST_FAMILY, layer, model)] = wandb.Histogram(
                np_histogram=(histogram.counts, histogram.edges)
            )
        every = self.options.profile_every
        if every is not None and record.step % every == 0:
            row[metric_key(PROFILE_FAMILY, "norm_by_depth", model)] = self._profile(record)
        return row

    def _profile(self, record: StepRecord) -> Any:
        import wandb

        norms = record.column("norm")
        rows = [
            [
                depth,
                layer,
                float(norm),
                math.log10(norm) if norm > 0 and math.isfinite(norm) else None,
            ]
            for depth, (layer, norm) in enumerate(zip(record.layers, norms))
        ]
        table = wandb.Table(columns=["depth", "layer", "norm", "log10_norm"], data=rows)
        return wandb.plot.line(
            table, "depth", "log10_norm", title=f"gradient flow by depth, step {record.step}"
        )

    def _log_pictures(self, run: Run) -> None:
        """The pictures as images in the run summary (a history row of their own would
        shift the user's step count), ``grad_pictures/[<model_name>/]<name>``."""
        import tempfile

        import wandb

        with tempfile.TemporaryDirectory(prefix="gradtrack-pictures-") as directory:
            paths = self._pictures.draw(Path(directory), run.name or run.id, f"W&B run {run.id}")
            model = self.config.model_name
            images = {
                metric_key(PICTURES_FAMILY, path.stem, model): wandb.Image(str(path))
                for path in paths
                if path.suffix == ".png"
            }
            if images:
                run.summary.update(images)  # W&B copies the files into the run here
