"""Weights & Biases sink: gradtrack's steps on their own axis, never moving the user's steps.

W&B keeps one history row open at a time and numbers rows with ``_step``. Whoever commits a
row moves that number, so gradtrack commits rows only in a run it started and nobody else
logs to. In any other run each gradtrack step rides in one of the user's rows, staged with
``commit=False`` into the open row while that row holds no gradtrack step yet; a placement
thread waits for the user's next row. Charts use ``gradtrack/step`` (``define_metric``), so a
step that rides a later row is still drawn at its own step. A user row carries one
gradtrack step; steps still waiting when the run finishes (or the interpreter exits) get
rows of their own then, after all of the user's rows, when nobody can log any more. Beyond
``PENDING_LIMIT`` waiting steps the oldest are dropped and counted in the
``gradtrack/coalesced`` summary value (see the README's W&B section).

wandb is imported only when the first step is written; a run already active is reused.
"""

from __future__ import annotations

import atexit
import math
import threading
import time
import warnings
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradtrack import lifecycle
from gradtrack.alerts import AlertEvent
from gradtrack.config import GradtrackConfig, redacted_config
from gradtrack.errors import GradtrackError
from gradtrack.record import FAMILIES, StepRecord, metric_key, safe_key, scalar_metrics
from gradtrack.sinks.base import require_module

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run

HIST_FAMILY = "grad_hist"
PICTURES_FAMILY = "grad_pictures"  # summary images: grad_pictures/<name>
LAYERS_CONFIG_KEY = "gradtrack_layers"  # layer names in depth order, for readers
PROFILE_FAMILY = "grad_profile"
# Steps waiting for a user row to ride. They keep their order (charts draw them at their own
# gradtrack/step either way), and those still waiting when the run finishes get rows of their
# own then. Beyond this many the oldest are dropped and counted: a user who logs less often
# than gradtrack would otherwise see its charts fall ever further behind training.
PENDING_LIMIT = 1024
# How often the placement thread looks for the user's next row: every millisecond for a
# while after a placement (a user row per training step), then backing off to POLL_MAX_S
# while the user logs rarely, so a quiet run costs a few wake-ups a second. Two rows the
# user commits within one look leave one of them unridden.
POLL_MIN_S = 0.001
POLL_FAST_FOR_S = 0.25
POLL_MAX_S = 0.05
PLACER_JOIN_S = 5.0

_exiting = False  # set by our exit hook: the user's code has ended, nobody logs any more
# Sinks closed while the user's run goes on, holding steps that found no row of the user's:
# they get rows of their own when that run finishes or the interpreter exits.
_AWAITING_RUN_END: set[WandbSink] = set()


def _close_watchers_before_wandb_exits() -> None:
    global _exiting
    _exiting = True
    lifecycle.close_open_watchers()
    for sink in list(_AWAITING_RUN_END):
        sink._on_finish()


def _order_exit_hook() -> None:
    """(Re-)register our exit hook so it runs before every W&B hook registered so far.

    atexit runs hooks last-registered first; W&B registers the teardown of its service
    process when the first run starts, and anything logged after that teardown is lost
    (MailboxClosedError). Moving our hook to the end of the list puts it first.
    """
    atexit.unregister(_close_watchers_before_wandb_exits)
    atexit.register(_close_watchers_before_wandb_exits)


_reorders_at_shutdown = False


def _register_exit_hooks() -> None:
    """Order our exit hook now, and once more when the interpreter starts shutting down.

    A run started after the last sink call (``gradtrack.watch`` first, ``wandb.init`` later,
    a loop shorter than the first hand-off) registers W&B's hooks after ours. The threading
    module calls its own exit hooks before any atexit hook (``concurrent.futures`` relies
    on it), so reordering from there puts ours first whatever started when.
    """
    global _reorders_at_shutdown
    _order_exit_hook()
    register = getattr(threading, "_register_atexit", None)
    if register is None or _reorders_at_shutdown:
        return
    try:
        register(_order_exit_hook)
        _reorders_at_shutdown = True
    except RuntimeError:  # already shutting down: the atexit order is what it is
        pass


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
        self.step_key = safe_key(f"gradtrack/{model}/step" if model else "gradtrack/step")
        self.coalesced_key = safe_key(
            f"gradtrack/{model}/coalesced" if model else "gradtrack/coalesced"
        )
        self._run = run
        self._bound = False  # step axis declared and finish hook set on self._run
        self._owns_run = False
        self._own_rows: int | None = None  # rows committed while gradtrack alone logs
        self._staged_at: int | None = None  # W&B row that may hold our last staged step
        self._extreme_names: tuple[str, str] | None = None
        self._layers: list[str] = []
        self._first_nonfinite_logged = False
        # The report package draws; imported here, not at the top: it sits above the sinks.
        from gradtrack.report.live import Pictures

        self._pictures = Pictures(self.options.pictures, self.options.pictures_every)
        # Steps waiting for a user row, and the thread that places them.
        self._pending: deque[StepRecord] = deque()
        self._changed = threading.Condition()
        self._placing = False  # a step taken from _pending is being logged
        self._blocked = False  # the open row holds our step: waiting for the user
        self._stopping = False
        # Started here, in the caller's thread, not lazily in the one calling write(): a
        # new thread inherits its creator's scheduling priority, and gradtrack's delivery
        # threads yield to training, while riding the user's rows needs a prompt look
        # (measured under load: 452 of 600 rows ridden at normal priority, 354 at nice 10).
        # It only wakes to look for a row while steps wait, so the training loop loses little.
        self._placer = threading.Thread(
            target=self._place_loop, name="gradtrack-wandb-rows", daemon=True
        )
        self._placer_error: BaseException | None = None
        self._waiting_since: float | None = None  # when the placer began to wait for a row
        self.coalesced = 0  # steps dropped for want of a user row
        self._coalesced_published = 0
        self._warned_coalesced = False
        self._placer.start()
        _register_exit_hooks()

    # -- run lifecycle ---------------------------------------------------------------------
    @property
    def run(self) -> Run:
        """The W&B run: the one given, else the active one, else one started now."""
        if self._run is not None and self._bound:
            return self._run
        if self._run is None:
            import wandb

            if wandb.run is not None:
                self._run = wandb.run
            else:
                options = self.options
                self._run = wandb.init(
                    project=options.project, entity=options.entity, name=options.name,
                    group=options.group, tags=list(options.tags) or None, mode=options.mode,
                    dir=options.dir, config={"gradtrack": redacted_config(self.config)},
                )  # fmt: skip
                self._owns_run = True
                self._own_rows = _next_row(self._run)
        # Once per run, given or found: a run handed in (a Lightning WandbLogger's) needs
        # the step axis and the finish hook as much as one gradtrack found or started.
        self._bound = True
        self._hook_into_finish(self._run)
        _order_exit_hook()  # W&B may have registered its own exit hooks just now
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
        if self._placer_error is not None:
            raise GradtrackError(f"placing steps in W&B rows failed: {self._placer_error!r}")
        self._record_layer_order(run, batch)
        if self._alone_in_run(run):
            for record in batch:
                run.log(self.row(record), commit=True)
            self._own_rows = _next_row(run)
        else:
            self._enqueue(batch)
        self._publish_coalesced(run)
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

    def _alone_in_run(self, run: Run) -> bool:
        """True while gradtrack started the run and no row but its own was committed."""
        if self._own_rows is None:
            return False
        if _next_row(run) != self._own_rows:
            # Someone else logs too: from now on ride their rows, never move their steps.
            self._own_rows = None
        return self._own_rows is not None

    def _record_layer_order(self, run: Run, batch: Sequence[StepRecord]) -> None:
        new = [layer for r in batch for layer in r.layers if layer not in self._layers]
        if new:
            self._layers.extend(dict.fromkeys(new))
            run.config.update({LAYERS_CONFIG_KEY: self._layers}, allow_val_change=True)

    # -- riding the user's rows ------------------------------------------------------------
    def _enqueue(self, batch: Sequence[StepRecord]) -> None:
        with self._changed:
            self._pending.extend(batch)
            while len(self._pending) > PENDING_LIMIT:
                self._pending.popleft()
                self.coalesced += 1
            self._blocked = False
            self._changed.notify_all()

    def _place_loop(self) -> None:
        try:
            while self._place_next():
                pass
        except Exception as error:  # reported by the next write, so the worker counts it
            self._placer_error = error
        finally:
            with self._changed:
                self._placing = False
                self._blocked = True  # nothing moves any more: let flush() return
                self._changed.notify_all()

    def _place_next(self) -> bool:
        """Stage the oldest waiting step once the open row holds none of ours; False: stop."""
        with self._changed:
            self._changed.wait_for(lambda: self._stopping or bool(self._pending))
            if self._stopping:
                return False
        run = self._run  # bound before the first step was queued
        assert run is not None
        if _finished(run):
            return False
        if self._holds_ours(run):
            with self._changed:  # the open row may hold our last step: wait for the user's next
                self._blocked = True
                self._changed.notify_all()
            time.sleep(self._poll_interval())
            return True
        self._waiting_since = None
        with self._changed:
            record = self._pending.popleft()
            self._placing = True
        run.log(self.row(record), commit=False)
        # Had the user committed meanwhile, our step could be in either row; taking W&B's
        # open row now (asked after our log, in order) means we never overwrite it.
        staged_at = run.step
        with self._changed:
            self._staged_at = staged_at
            self._placing = False
            self._changed.notify_all()
        return True

    def _poll_interval(self) -> float:
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        waited = now - self._waiting_since
        if waited < POLL_FAST_FOR_S:
            return POLL_MIN_S
        return min(POLL_MAX_S, POLL_MIN_S * 2 ** ((waited - POLL_FAST_FOR_S) / 0.05))

    def _holds_ours(self, run: Run) -> bool:
        """Whether the open row may still hold our last staged step.

        ``_staged_at`` is W&B's own count, asked after our log, and can run ahead of the
        SDK's ``_local_step`` while the user's ``log`` is between sending its row and
        counting it. Only a count past ``_staged_at`` proves the user committed a row after
        ours, so anything else counts as "may hold ours".
        """
        return self._staged_at is not None and _next_row(run) <= self._staged_at

    def _stop_placer(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        if self._placer.is_alive():
            self._placer.join(PLACER_JOIN_S)

    def _place_the_rest(self, run: Run) -> None:
        """The steps still waiting, in rows of their own: only once nobody else can log
        (the run is finishing, or the interpreter exits), so no one's steps move."""
        with self._changed:
            rest = list(self._pending)
            self._pending.clear()
        for record in rest:
            if self._holds_ours(run):
                run.log({}, commit=True)  # commit the row holding our previous step
            run.log(self.row(record), commit=False)
            self._staged_at = _next_row(run)

    def _hook_into_finish(self, run: Run) -> None:
        """Have W&B call us at the start of ``finish()``, while the run still takes rows.

        W&B runs its "early" teardown hooks there (its own Jupyter support uses them); the
        list is not public API: without it, steps still waiting at ``finish()`` are lost,
        counted and warned about at exit.
        """
        try:
            from wandb.sdk.wandb_run import TeardownHook, TeardownStage
        except ImportError:  # pragma: no cover - a future wandb without them
            return
        hooks = getattr(run, "_teardown_hooks", None)
        if isinstance(hooks, list):
            hooks.append(TeardownHook(call=self._on_finish, stage=TeardownStage.EARLY))

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
        _AWAITING_RUN_END.discard(self)
        self._stop_placer()
        run = self._run
        if run is None or _finished(run):
            with self._changed:
                self.coalesced += len(self._pending)
                self._pending.clear()
            self._warn_coalesced()
            return
        self._place_the_rest(run)
        self._publish_coalesced(run)

    def _publish_coalesced(self, run: Run) -> None:
        if self.coalesced != self._coalesced_published:
            self._coalesced_published = self.coalesced
            run.summary[self.coalesced_key] = self.coalesced

    def _warn_coalesced(self) -> None:
        if self.coalesced and not self._warned_coalesced:
            self._warned_coalesced = True
            warnings.warn(
                f"gradtrack left {self.coalesced} steps out of the W&B run (summary "
                f"{self.coalesced_key}): in a run you log to, each of gradtrack's steps rides "
                f"one of your rows, and more than {PENDING_LIMIT} waited for one. Log to W&B "
                "at least as often as gradtrack logs (log_every), or let gradtrack start the "
                "run",
                RuntimeWarning,
                stacklevel=2,
            )

    # -- rows ------------------------------------------------------------------------------
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
        """Wait (bounded) until every waiting step rides a row, or waits for the user's next."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._blocked or not (self._pending or self._placing),
                timeout=self.config.flush_timeout_s,
            )

    def close(self) -> None:
        run = self._run
        if run is not None and not _finished(run) and self._pictures.due_at_close():
            self._log_pictures(run)  # summary images, not rows
        self._stop_placer()
        if run is None or _finished(run):
            with self._changed:
                self.coalesced += len(self._pending)
                self._pending.clear()
        elif self._owns_run or _exiting:
            self._on_run_end()
            if self._owns_run:
                run.finish()
        elif self._pending:
            # The user's run goes on and may still log rows: the waiting steps wait for its
            # finish() (or the interpreter's exit) to get rows of their own.
            _AWAITING_RUN_END.add(self)
        self._warn_coalesced()


def _next_row(run: Run) -> int:
    """W&B's number for the open history row (the ``_step`` of the next commit).

    The SDK keeps it in ``_local_step`` on the calling side, updated right after each
    ``log`` is sent; reading it costs nothing, where the public ``run.step`` is a round trip
    to W&B's service. Falls back to ``run.step`` should the attribute go away.
    """
    step = getattr(run, "_local_step", None)
    return step if isinstance(step, int) else run.step


def _finished(run: Run) -> bool:
    # wandb has no public flag; a finished run hangs 30 s on `run.step`, so ask first.
    return bool(getattr(run, "_is_finished", False))
