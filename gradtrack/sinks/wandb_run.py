"""The W&B run the W&B sink logs to: the one given, else the active one, else one it starts.

Whichever it is, it is bound once: gradtrack's metrics are plotted against its own step
metric (``define_metric``), and W&B calls the sink at the start of ``finish()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gradtrack.config import GradtrackConfig, redacted_config
from gradtrack.errors import GradtrackError
from gradtrack.formats.keys import FAMILIES
from gradtrack.formats.wandb import HIST_FAMILY, PROFILE_FAMILY
from gradtrack.sinks.wandb_exit import order_exit_hook

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run


class WandbRun:
    """Finds, starts and binds the run; knows whether gradtrack alone logs to it."""

    def __init__(
        self,
        config: GradtrackConfig,
        run: Run | None,
        step_key: str,
        on_finish: Callable[[], None],
    ) -> None:
        self.config = config
        self.run = run  # None until found or started; not yet bound until `bound()`
        self.owns_run = False
        self._step_key = step_key
        self._on_finish = on_finish
        self._bound = False  # step axis declared and finish hook set on self.run
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
                    project=options.project, entity=options.entity, name=options.name,
                    group=options.group, tags=list(options.tags) or None, mode=options.mode,
                    dir=options.dir, config={"gradtrack": redacted_config(self.config)},
                )  # fmt: skip
                self.owns_run = True
                self._own_rows = next_row(self.run)
        # Once per run, given or found: a run handed in (a Lightning WandbLogger's) needs
        # the step axis and the finish hook as much as one gradtrack found or started.
        self._bound = True
        self._hook_into_finish(self.run)
        order_exit_hook()  # W&B may have registered its own exit hooks just now
        self._declare_step_axis(self.run)
        return self.run

    def _declare_step_axis(self, run: Run) -> None:
        run.define_metric(self._step_key, hidden=True)
        model = self.config.model_name
        for family in (*FAMILIES, HIST_FAMILY, PROFILE_FAMILY):
            pattern = f"{family}/{model}/*" if model else f"{family}/*"
            run.define_metric(pattern, step_metric=self._step_key)

    def live(self) -> Run:
        """The bound run; an error once it is finished."""
        run = self.bound()
        if finished(run):
            raise GradtrackError(
                "the W&B run was finished before gradtrack's watcher closed; gradtrack stops "
                "logging to it (close the watcher before wandb.finish())"
            )
        return run

    def alone_in(self, run: Run) -> bool:
        """True while gradtrack started the run and no row but its own was committed."""
        if self._own_rows is None:
            return False
        if next_row(run) != self._own_rows:
            # Someone else logs too: from now on ride their rows, never move their steps.
            self._own_rows = None
        return self._own_rows is not None

    def rows_logged(self, run: Run) -> None:
        """gradtrack committed rows of its own (while alone in the run)."""
        self._own_rows = next_row(run)

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


def next_row(run: Run) -> int:
    """W&B's number for the open history row (the ``_step`` of the next commit).

    The SDK keeps it in ``_local_step`` on the calling side, updated right after each
    ``log`` is sent; reading it costs nothing, where the public ``run.step`` is a round trip
    to W&B's service. Falls back to ``run.step`` should the attribute go away.
    """
    step = getattr(run, "_local_step", None)
    return step if isinstance(step, int) else run.step


def finished(run: Run) -> bool:
    # wandb has no public flag; a finished run hangs 30 s on `run.step`, so ask first.
    return bool(getattr(run, "_is_finished", False))
