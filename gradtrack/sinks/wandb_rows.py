"""Which of gradtrack's steps ride the user's W&B rows, never moving the user's steps.

W&B keeps one history row open at a time and numbers rows with ``_step``; whoever commits a
row moves that number. In a run the user logs to, gradtrack therefore never commits: it stages
the NEWEST step of each batch it is handed into the open row (``log(..., commit=False)``), the
row the user's next ``wandb.log`` commits, with ``step=`` or without. Every step is in the
run's step files anyway (`gradtrack.sinks.wandb_file`); the rows are for charts, kept current.

A later step staged into a row that still holds an earlier one replaces that step's values key
by key; a key the earlier step had and the later lacks (a histogram, the profile, a non-zero
NaN count) would stay, drawn at the later step. So while the open row may hold our last step
(``run.step``, W&B's number of the open row, has not moved past it), only a step whose keys
include all of that step's keys replaces it; otherwise the row keeps its step for the user's
next commit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from gradtrack.formats.record import StepRecord

if TYPE_CHECKING:
    from wandb import Run


class RowRider:
    """Stages one step per batch into the user's open row; knows what the row may hold."""

    def __init__(self, row: Callable[[StepRecord], dict[str, Any]]) -> None:
        self._row = row
        self._staged_at: int | None = None  # W&B's open row right after our last staging
        self._staged_keys: frozenset[str] = frozenset()

    def ride(self, run: Run, batch: Sequence[StepRecord]) -> int | None:
        """Stage the newest step of ``batch`` the open row can take; the step staged, or None."""
        may_hold_ours = self._staged_at is not None and run.step <= self._staged_at
        for record in reversed(batch):
            row = self._row(record)
            if may_hold_ours and not self._staged_keys <= row.keys():
                continue
            run.log(row, commit=False)
            # Asked after our log (W&B answers in order): had the user committed meanwhile,
            # our step is in the row before this number, and "may hold ours" errs on the
            # safe side.
            self._staged_at = run.step
            self._staged_keys = frozenset(row)
            return record.step
        return None
