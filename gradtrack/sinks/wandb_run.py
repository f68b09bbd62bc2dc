"""The W&B run the W&B sink logs to: the one given, else the active one, else one it starts.

Whichever it is, it is bound once: gradtrack's metrics are plotted against its own step
metric (``define_metric``). Only W&B's public API is used: ``run.step`` (W&B's number of the
open row, a round trip to its service) tells whether anyone else commits rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradtrack.config import GradtrackConfig, redacted_config
from gradtrack.errors import GradtrackError
from gradtrack.formats.keys import FAMILIES
from gradtrack.formats.wandb import HIST_FAMILY, PROFILE_FAMILY

if TYPE_CHECKING:
    from wandb import Run

FINISHED_MESSAGE = (
    "the W&B run was finished before gradtrack's watcher closed; gradtrack stops logging to "
    "it (close the watcher before wandb.finish())"
)


class WandbRun:
    """Finds, starts and binds the run; knows whether gradtrack alone logs to it."""

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
                    project=options.project, entity=options.entity, name=options.name,
                    group=options.group, tags=list(options.tags) or None, mode=options.mode,
                    dir=options.dir, config={"gradtrack": redacted_config(self.config)},
                )  # fmt: skip
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
