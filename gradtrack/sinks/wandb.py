"""Weights & Biases sink: one history row per logged step on gradtrack's own step axis.

wandb is imported only when the first step is written; a run already active is reused.
"""

from __future__ import annotations

import atexit
import math
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradtrack.alerts import AlertEvent
from gradtrack.config import GradtrackConfig
from gradtrack.errors import GradtrackError
from gradtrack.record import FAMILIES, StepRecord, metric_key, safe_key, scalar_metrics
from gradtrack.sinks.base import require_module

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run

HIST_FAMILY = "grad_hist"
PICTURES_FAMILY = "grad_pictures"  # summary images: grad_pictures/<name>
LAYERS_CONFIG_KEY = "gradtrack_layers"  # layer names in depth order, for readers
PROFILE_FAMILY = "grad_profile"


class WandbSink:
    """Logs every step to W&B: metrics, histograms, a gradient-flow profile and alerts.

    Rows do not disturb the user's own ``wandb.log`` calls: gradtrack's values go into the
    row that is open (the user's next one) unless that row already holds a gradtrack step,
    and its metrics are plotted against ``gradtrack/step`` (set with ``define_metric``).
    """

    def __init__(self, config: GradtrackConfig | None = None, run: Run | None = None) -> None:
        require_module("wandb", "wandb")
        self.config = config or GradtrackConfig()
        self.options = self.config.wandb
        model = self.config.model_name
        self.step_key = safe_key(f"gradtrack/{model}/step" if model else "gradtrack/step")
        self._run = run
        self._owns_run = False
        self._staged_at: int | None = None  # W&B step of our row still open, if any
        self._extreme_names: tuple[str, str] | None = None
        self._layers: list[str] = []
        self._first_nonfinite_logged = False
        # The report package draws; imported here, not at the top: it sits above the sinks.
        from gradtrack.report.live import Pictures

        self._pictures = Pictures(self.options.pictures, self.options.pictures_every)

    # -- run lifecycle ---------------------------------------------------------------------
    @property
    def run(self) -> Run:
        """The W&B run: the one given, else the active one, else one started now."""
        if self._run is None:
            import wandb

            if wandb.run is not None:
                self._run = wandb.run
            else:
                options = self.options
                self._run = wandb.init(
                    project=options.project, entity=options.entity, name=options.name,
                    group=options.group, tags=list(options.tags) or None, mode=options.mode,
                    dir=options.dir, config={"gradtrack": self.config.model_dump(mode="json")},
                )  # fmt: skip
                self._owns_run = True
                # Our exit hook must run before the one wandb.init just registered.
                from gradtrack.watcher import close_open_watchers

                atexit.register(close_open_watchers)
            self._declare_step_axis(self._run)
        return self._run

    def _declare_step_axis(self, run: Run) -> None:
        run.define_metric(self.step_key, hidden=True)
        model = self.config.model_name
        for family in (*FAMILIES, HIST_FAMILY, PROFILE_FAMILY):
            pattern = f"{family}/{model}/*" if model else f"{family}/*"
            run.define_metric(pattern, step_metric=self.step_key)

    def _live_run(self) -> Run:
        run = self.run
        if _finished(run):
            raise GradtrackError(
                "the W&B run was finished before gradtrack's watcher closed; gradtrack stops "
                "logging to it (close the watcher before wandb.finish())"
            )
        return run

    # -- GradientSink ----------------------------------------------------------------------
    def write(self, batch: Sequence[StepRecord]) -> None:
        run = self._live_run()
        self._record_layer_order(run, batch)
        # Stage each step into the open row (the user's next one), so their step count is
        # untouched; commit first only while that row still holds one of our steps. Asking
        # W&B for its step is a round trip, so it is asked once before and once after.
        ours_open = self._staged_at is not None and run.step == self._staged_at
        for record in batch:
            if ours_open:
                run.log({}, commit=True)
            run.log(self.row(record), commit=False)
            ours_open = True
        # Had the user committed meanwhile, our last row could be in either row; taking the
        # open one means the next step can never overwrite it (at worst it commits early).
        self._staged_at = run.step
        extremes = batch[-1].extreme_layers()
        names = None if extremes is None else (extremes[0][0], extremes[1][0])
        if names is not None and names != self._extreme_names:
            self._extreme_names = names
            run.summary["gradtrack/weakest_layer"] = names[0]
            run.summary["gradtrack/strongest_layer"] = names[1]
        if self._pictures.add(batch):
            self._log_pictures(run)

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

    def _record_layer_order(self, run: Run, batch: Sequence[StepRecord]) -> None:
        new = [layer for r in batch for layer in r.layers if layer not in self._layers]
        if new:
            self._layers.extend(dict.fromkeys(new))
            run.config.update({LAYERS_CONFIG_KEY: self._layers}, allow_val_change=True)

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

    def alert(self, event: AlertEvent) -> None:
        from wandb.sdk.wandb_alerts import AlertLevel

        self._pictures.alert(event)
        run = self._live_run()
        levels = {"info": AlertLevel.INFO, "warning": AlertLevel.WARN, "error": AlertLevel.ERROR}
        level = levels[event.severity]
        # gradtrack's own per-rule cooldown already spaced these out; W&B's minimum wait
        # only stops it from merging distinct events that share a title.
        text = f"step {event.step}: {event.message}"
        run.alert(title=event.title, text=text, level=level, wait_duration=timedelta(seconds=1))
        if event.rule == "nonfinite" and not self._first_nonfinite_logged:
            self._first_nonfinite_logged = True
            run.summary["gradtrack/first_nonfinite_step"] = event.step
            run.summary["gradtrack/first_nonfinite_layer"] = event.origin_layer or ""
            run.summary["gradtrack/first_nonfinite_stage"] = event.origin_stage or ""

    def flush(self) -> None:
        run = self._run
        if run is None or _finished(run) or self._staged_at is None:
            return
        if run.step == self._staged_at:  # our last row is still open: commit it
            run.log({}, commit=True)
        self._staged_at = None

    def close(self) -> None:
        run = self._run
        if run is not None and not _finished(run) and self._pictures.due_at_close():
            self._log_pictures(run)
        self.flush()
        if self._owns_run and self._run is not None and not _finished(self._run):
            self._run.finish()


def _finished(run: Run) -> bool:
    # wandb has no public flag; a finished run hangs 30 s on `run.step`, so ask first.
    return bool(getattr(run, "_is_finished", False))
