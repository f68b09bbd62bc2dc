"""Weights & Biases sink: every step in the run, charts current, the user's steps never moved.

Every step the sink is handed goes into the run's step files (`StepFiles`), written as
training goes. In a run gradtrack started, each step is also a history row of its own while
nobody else logs; in any other run the newest step of each batch rides the user's open row
(`RowRider`). Charts use ``gradtrack/step`` (``define_metric``). The run is found, started and
bound by `WandbRun`; the names written are in `gradtrack.formats.wandb`. Only W&B's public API
is used.

wandb is imported only when the first step is written; a run already active is reused.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from gradtrack.config import GradtrackConfig, redacted_config
from gradtrack.errors import GradtrackError, require_module
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.flight import FLIGHT_DIR, FlightWindow
from gradtrack.formats.metrics import FAMILIES, metric_key, scalar_metrics
from gradtrack.formats.record import StepRecord
from gradtrack.formats.wandb import (
    HIST_FAMILY,
    LAYERS_CONFIG_KEY,
    PICTURES_FAMILY,
    PROFILE_FAMILY,
    part_name,
    step_line,
    steps_dir,
)
from gradtrack.sinks.base import RunBook, SinkBase

if TYPE_CHECKING:
    from wandb import Run

PART_BYTES = 1 << 20  # a step file this large is closed; the next line starts a new one
FINISHED_MESSAGE = (
    "the W&B run was finished before gradtrack's watcher closed; gradtrack stops logging to "
    "it (close the watcher before wandb.finish())"
)


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
        self._media = MediaClock(self.options.media_every_s)
        self._rows = RowRider(self.row, self._media, self._media_due)

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
                media = self._media_due(record) and self._media.allows()
                run.log(self.row(record, media), commit=True)
                if media:
                    self._media.took()
            self._wandb_run.rows_logged(run, len(batch))
        else:
            self._rows.ride(run, batch)
        if self._pictures.add(batch):
            self._log_pictures(run)

    def _write_window(self, run: Run, window: FlightWindow) -> None:
        """A flight recorder's window: its file among the run's files (W&B's history takes
        no step before the last one logged), its picture in the run summary."""
        import wandb

        from gradtrack.report.live import stage_window

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
        """Each write reached the step files and the run before returning; the newest step
        whose histograms waited for `MediaClock` rides the open row with them."""
        run = self._wandb_run.run
        if run is None:
            return
        try:
            self._settle(run)
        except Exception as error:
            raise finished_error(error) or error from None

    def close(self) -> None:
        self._files.close()
        run = self._wandb_run.run
        if run is None:
            return
        try:
            self._settle(run)
            if self._pictures.due_at_close():
                self._log_pictures(run)  # summary images, not rows
        except Exception as error:
            if finished_error(error) is None:
                raise
            return  # the run was finished first: that was warned about at the write
        if self._wandb_run.owns_run:
            run.finish()

    def _settle(self, run: Run) -> None:
        if not self._rows.holds_back:  # (only riding holds a step back: never while alone)
            return
        # Refused at once by a finished run, before `run.step`'s round trip would wait 30 s.
        run.summary.update({self.files_key: self._files.steps})
        self._rows.settle(run)

    # -- rows and pictures -----------------------------------------------------------------
    def row(self, record: StepRecord, media: bool = True) -> dict[str, Any]:
        """The history row for one step: metrics and, with ``media``, its histograms and,
        when due, the profile."""
        import wandb

        row: dict[str, Any] = {self.step_key: record.step, **scalar_metrics(record)}
        if not media:
            return row
        model = self.config.model_name
        for layer, histogram in record.histograms.items():
            row[metric_key(HIST_FAMILY, layer, model)] = wandb.Histogram(
                np_histogram=(histogram.counts, histogram.edges)
            )
        if self._profile_due(record):
            row[metric_key(PROFILE_FAMILY, "norm_by_depth", model)] = self._profile(record)
        return row

    def _media_due(self, record: StepRecord) -> bool:
        """Whether the step has histograms or a profile for its row."""
        return bool(record.histograms) or self._profile_due(record)

    def _profile_due(self, record: StepRecord) -> bool:
        every = self.options.profile_every
        return every is not None and record.step % every == 0

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


class WandbRun:
    """The run the sink logs to: the one given, else the active one, else one it starts;
    knows whether gradtrack alone logs to it.

    Whichever it is, it is bound once: gradtrack's metrics are plotted against its own step
    metric (``define_metric``). ``run.step`` (W&B's number of the open row, a round trip to
    its service) tells whether anyone else commits rows.
    """

    def __init__(self, config: GradtrackConfig, run: Run | None, step_key: str) -> None:
        self.config = config
        self.run = run  # None until found or started; not yet bound until `bound()`
        self.owns_run = False
        self._step_key = step_key
        self._bound = False  # step axis declared on self.run
        self._own_rows: int | None = None  # rows committed while gradtrack alone logs

    def bound(self) -> Run:
        """The W&B run: the one given, else the active one, else one started now."""
        if self.run is not None and self._bound:
            return self.run
        if self.run is None:
            import wandb

            if wandb.run is not None:
                self.run = wandb.run
            else:
                options = self.config.wandb
                self.run = wandb.init(
                    project=options.project,
                    entity=options.entity,
                    name=options.name,
                    group=options.group,
                    tags=list(options.tags) or None,
                    mode=options.mode,
                    dir=options.dir,
                    config={"gradtrack": redacted_config(self.config)},
                )
                self.owns_run = True
                self._own_rows = self.run.step
        # Once per run, given or found: a run handed in (a Lightning WandbLogger's) needs
        # the step axis as much as one gradtrack found or started.
        self._bound = True
        self._declare_step_axis(self.run)
        return self.run

    def _declare_step_axis(self, run: Run) -> None:
        run.define_metric(self._step_key, hidden=True)
        model = self.config.model_name
        for family in (*FAMILIES, HIST_FAMILY, PROFILE_FAMILY):
            pattern = f"{family}/{model}/*" if model else f"{family}/*"
            run.define_metric(pattern, step_metric=self._step_key)

    def alone_in(self, run: Run) -> bool:
        """True while gradtrack started the run and no row but its own was committed."""
        if self._own_rows is None:
            return False
        if run.step != self._own_rows:
            # Someone else logs too: from now on ride their rows, never move their steps.
            self._own_rows = None
        return self._own_rows is not None

    def rows_logged(self, run: Run, rows: int) -> None:
        """gradtrack committed ``rows`` rows of its own (while alone in the run)."""
        if self._own_rows is not None:
            self._own_rows += rows


def finished_error(error: Exception) -> GradtrackError | None:
    """The error to raise when ``error`` says the run is finished (W&B's ``UsageError``)."""
    from wandb.errors import UsageError

    if isinstance(error, UsageError):
        return GradtrackError(FINISHED_MESSAGE)
    return None


class MediaClock:
    """When a row may carry media — histograms, the profile — in W&B: at most once per
    ``every_s`` seconds (None: whenever due). W&B's SDK spends 2–3 ms of the training
    process's Python on each histogram or table it logs (0.4 ms on a row of scalars), and
    at the defaults a 0.26 ms step has them due every 26 ms; the step files hold every one."""

    def __init__(self, every_s: float | None) -> None:
        self.every_s = every_s
        self._last = -math.inf

    def allows(self) -> bool:
        return self.every_s is None or time.monotonic() - self._last >= self.every_s

    def took(self) -> None:
        """A row with media was logged now."""
        self._last = time.monotonic()


class RowRider:
    """Stages one step per batch into the user's open row; knows what the row may hold.

    W&B keeps one history row open at a time and numbers rows with ``_step``; whoever
    commits a row moves that number. In a run the user logs to, gradtrack therefore never
    commits: it stages the NEWEST step of each batch it is handed into the open row
    (``log(..., commit=False)``), the row the user's next ``wandb.log`` commits, with
    ``step=`` or without. Every step is in the run's step files anyway (`StepFiles`); the
    rows are for charts, kept current.

    A later step staged into a row that still holds an earlier one replaces that step's
    values key by key; a key the earlier step had and the later lacks (a histogram, the
    profile, a non-zero NaN count) would stay, drawn at the later step. So while the open row
    may hold our last step (``run.step``, W&B's number of the open row, has not moved past
    it), only a step whose keys include all of that step's keys replaces it; otherwise the
    row keeps its step for the user's next commit.

    A step's histograms and profile come along only as often as `MediaClock` allows. Where
    the open row holds a step with them, which steps without them may not replace, the
    newest step whose media the clock held back rides with them at `settle` (flush, close).
    """

    def __init__(
        self,
        row: Callable[[StepRecord, bool], dict[str, Any]],
        media: MediaClock,
        media_due: Callable[[StepRecord], bool],
    ) -> None:
        self._row = row
        self._media = media
        self._media_due = media_due
        self._staged_at: int | None = None  # W&B's open row right after our last staging
        self._staged_keys: frozenset[str] = frozenset()
        self._staged_step = -1
        self._held_back: StepRecord | None = None  # the newest step whose media waited

    def ride(self, run: Run, batch: Sequence[StepRecord]) -> int | None:
        """Stage the newest step of ``batch`` the open row can take; the step staged, or None."""
        may_hold_ours = self._may_hold_ours(run)
        for record in reversed(batch):
            due = self._media_due(record)
            media = due and self._media.allows()
            if due and not media and record.step > self._held_step:
                self._held_back = record
            row = self._row(record, media)
            if may_hold_ours and not self._staged_keys <= row.keys():
                continue
            self._stage(run, record, row, media)
            return record.step
        return None

    def settle(self, run: Run) -> None:
        """The newest step whose media the clock held back, newer than the step the open
        row holds, staged with them (where the row can take it): before the row is
        committed at the end, its histograms are not older than the last ``histograms.every``
        steps."""
        held, self._held_back = self._held_back, None
        if held is None or held.step <= self._staged_step:
            return
        row = self._row(held, True)
        if not self._may_hold_ours(run) or self._staged_keys <= row.keys():
            self._stage(run, held, row, True)

    @property
    def holds_back(self) -> bool:
        """Whether a step whose media the clock held back waits for `settle`."""
        return self._held_back is not None

    @property
    def _held_step(self) -> int:
        return -1 if self._held_back is None else self._held_back.step

    def _may_hold_ours(self, run: Run) -> bool:
        return self._staged_at is not None and run.step <= self._staged_at

    def _stage(self, run: Run, record: StepRecord, row: dict[str, Any], media: bool) -> None:
        run.log(row, commit=False)
        # Asked after our log (W&B answers in order): had the user committed meanwhile, our
        # step is in the row before this number, and "may hold ours" errs on the safe side.
        self._staged_at = run.step
        self._staged_keys = frozenset(row)
        self._staged_step = record.step
        if media:
            self._media.took()


class StepFiles:
    """Every step the sink is handed, appended to step files the run carries, as training
    goes: to the run's current part, starting (and saving) a new one as due.

    The files sit in the run's own folder (``run.dir``) and are saved with ``run.save(...,
    policy="live")``: W&B uploads each as it grows (an offline run keeps them for ``wandb
    sync``). A file is closed once it passes ``PART_BYTES`` and the next one started, so a
    live upload never re-sends more than that. Format and reader: `gradtrack.formats.wandb`.
    """

    def __init__(self, model_name: str | None) -> None:
        self._folder = steps_dir(model_name)
        self._file: IO[str] | None = None
        self._written = 0  # bytes in the current part
        self.steps = 0  # lines written, all parts

    def append(self, run: Run, lines: Sequence[tuple[int, str]]) -> None:
        """Write ``(step, line)`` pairs, oldest first, flushed to the operating system."""
        for step, line in lines:
            if self._file is None or self._written >= PART_BYTES:
                self._start(run, step)
            assert self._file is not None
            self._file.write(line)
            self._written += len(line)
            self.steps += 1
        if self._file is not None:
            self._file.flush()  # what W&B's live upload reads, and a reader of the run dir

    def _start(self, run: Run, first_step: int) -> None:
        self.close()
        root = Path(run.dir)
        path = root / self._folder / part_name(first_step)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self._written = path.stat().st_size
        # Already in the run's folder: W&B only records the policy (no copy, no link).
        run.save(str(path), base_path=str(root), policy="live")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
