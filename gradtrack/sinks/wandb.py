"""Weights & Biases sink: every step in the run, charts current, the user's steps never moved.

Every step the sink is handed goes into the run's step files (`gradtrack.sinks.wandb_file`),
written as training goes. In a run gradtrack started, each step is also a history row of its
own while nobody else logs; in any other run the newest step of each batch rides the user's
open row (`gradtrack.sinks.wandb_rows`). Charts use ``gradtrack/step`` (``define_metric``).
The run is found, started and bound by `gradtrack.sinks.wandb_run`; the names written are in
`gradtrack.formats.wandb` and `gradtrack.formats.wandb_steps`. Only W&B's public API is used.

wandb is imported only when the first step is written; a run already active is reused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradtrack.config import GradtrackConfig
from gradtrack.extras import require_module
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.flight import FLIGHT_DIR, FlightWindow
from gradtrack.formats.keys import metric_key
from gradtrack.formats.metrics import scalar_metrics
from gradtrack.formats.record import StepRecord
from gradtrack.formats.wandb import HIST_FAMILY, LAYERS_CONFIG_KEY, PICTURES_FAMILY, PROFILE_FAMILY
from gradtrack.formats.wandb_steps import step_line
from gradtrack.sinks.base import SinkBase
from gradtrack.sinks.flight_files import stage_window
from gradtrack.sinks.runbook import RunBook
from gradtrack.sinks.wandb_file import StepFiles
from gradtrack.sinks.wandb_rows import RowRider
from gradtrack.sinks.wandb_run import WandbRun, finished_error

if TYPE_CHECKING:
    from wandb import Run


class WandbSink(SinkBase):
    """Logs every step to W&B: step files, chart rows, histograms, a gradient-flow profile
    and alerts.

    In a run gradtrack started, each step is a row of its own while nobody else logs. In
    the user's run (or once someone else logs), the newest step of each batch rides the
    user's open row: the user's ``_step`` numbering and rows are never touched, and every
    step is in the step files. gradtrack's metrics are plotted against ``gradtrack/step``.
    Called from its courier thread only.
    """

    def __init__(self, config: GradtrackConfig | None = None, run: Run | None = None) -> None:
        require_module("wandb", "wandb")
        self.config = config or GradtrackConfig()
        self.options = self.config.wandb
        model = self.config.model_name
        self.step_key = metric_key("gradtrack", "step", model)
        self.files_key = metric_key("gradtrack", "steps_in_files", model)
        self._wandb_run = WandbRun(self.config, run, self.step_key)
        self._book = RunBook()
        # The report package draws; imported here, not at the top: it sits above the sinks.
        from gradtrack.report.live import Pictures

        self._pictures = Pictures(self.options.pictures, self.options.pictures_every)
        self._files = StepFiles(model)
        self._rows = RowRider(self.row)

    @property
    def run(self) -> Run:
        """The W&B run: the one given, else the active one, else one started now."""
        return self._wandb_run.bound()

    # -- GradientSink ----------------------------------------------------------------------
    def write(self, batch: Sequence[StepRecord]) -> None:
        run = self._wandb_run.bound()
        try:
            self._write(run, batch)
        except Exception as error:
            raise finished_error(error) or error from None

    def _write(self, run: Run, batch: Sequence[StepRecord]) -> None:
        for record in batch:
            if record.flight is not None:
                self._write_window(run, record.flight)
        batch = [record for record in batch if not record.window_only]
        if not batch:
            return
        # The files first: what they hold is the run's complete record.
        self._files.append(run, [(r.step, self._line(r)) for r in batch])
        # Before any round trip: W&B refuses this at once once the run is finished, where
        # `run.step` would wait 30 s for its service.
        extremes = {f"gradtrack/{name}": v for name, v in self._book.extremes(batch[-1]).items()}
        run.summary.update({self.files_key: self._files.steps, **extremes})
        if self._book.add_layers(layer for record in batch for layer in record.layers):
            run.config.update({LAYERS_CONFIG_KEY: self._book.layers}, allow_val_change=True)
        if self._wandb_run.alone_in(run):
            for record in batch:
                run.log(self.row(record), commit=True)
            self._wandb_run.rows_logged(run, len(batch))
        else:
            self._rows.ride(run, batch)
        if self._pictures.add(batch):
            self._log_pictures(run)

    def _write_window(self, run: Run, window: FlightWindow) -> None:
        """A flight recorder's window: its file among the run's files (W&B's history takes
        no step before the last one logged), its picture in the run summary."""
        import wandb

        root = Path(run.dir)
        model = self.config.model_name
        folder = root / FLIGHT_DIR / model if model else root / FLIGHT_DIR
        for path in stage_window(window, folder, run.name or run.id):
            run.save(str(path), base_path=str(root), policy="now")
            if path.suffix == ".png":
                key = metric_key(PICTURES_FAMILY, f"flight_{window.incident_step}", model)
                run.summary[key] = wandb.Image(str(path))

    def alert(self, event: AlertEvent) -> None:
        self._pictures.alert(event)
        run = self._wandb_run.bound()
        levels = {"info": "INFO", "warning": "WARN", "error": "ERROR"}  # run.alert's levels
        level = levels[event.severity]
        # gradtrack's own per-rule cooldown already spaced these out; W&B's minimum wait
        # only stops it from merging distinct events that share a title.
        text = f"step {event.step}: {event.message}"
        try:
            run.alert(title=event.title, text=text, level=level, wait_duration=timedelta(seconds=1))
            for name, value in self._book.first_nonfinite(event).items():
                run.summary[f"gradtrack/{name}"] = value
        except Exception as error:
            raise finished_error(error) or error from None

    def flush(self) -> None:
        """Nothing waits here: each write reached the step files and the run before returning."""

    def close(self) -> None:
        self._files.close()
        run = self._wandb_run.run
        if run is None:
            return
        try:
            if self._pictures.due_at_close():
                self._log_pictures(run)  # summary images, not rows
        except Exception as error:
            if finished_error(error) is None:
                raise
            return  # the run was finished first: that was warned about at the write
        if self._wandb_run.owns_run:
            run.finish()

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

    def _line(self, record: StepRecord) -> str:
        """The step-file line for one step: the row's metrics and histograms, losslessly."""
        model = self.config.model_name
        histograms = {
            metric_key(HIST_FAMILY, layer, model): histogram
            for layer, histogram in record.histograms.items()
        }
        return step_line(record.step, scalar_metrics(record), histograms)

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
