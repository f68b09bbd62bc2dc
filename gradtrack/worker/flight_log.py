"""The flight recorder on the worker: the steps the training thread's ring handed on, kept on
the host, and the window an incident sends — once, on the incident's record, with its first
mover named in the incident's event (`gradtrack.worker.first_mover`).

An incident is a ``nonfinite``, ``spike`` or ``exploding`` event, any event whose rule
raises or skips, a skipped step, or training that ended in an exception or Ctrl-C.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from gradtrack.formats.event import AlertEvent
from gradtrack.formats.flight import FlightWindow
from gradtrack.formats.record import StepRecord
from gradtrack.handoff.layout import TENSOR_COLUMNS
from gradtrack.log import report
from gradtrack.worker.first_mover import first_mover, first_mover_sentence

INCIDENT_RULES = ("nonfinite", "spike", "exploding")
_WHAT = {"nonfinite": "the non-finite gradient", "spike": "the spike", "exploding": "the explosion"}

RuleAction = Callable[[str, str | None], str]  # (rule, layer) -> its action


class FlightLog:
    """The host copy of the last ``steps + slack`` steps' layer norms (``slack``: the steps
    an accelerator's latched incident may be found after its own, ``log_every``)."""

    def __init__(
        self, layer_names: Sequence[str], steps: int, slack: int, action: RuleAction
    ) -> None:
        self.layers = tuple(layer_names)
        self.steps = steps
        capacity = steps + 1 + slack
        self._step = np.full(capacity, -1, dtype=np.int64)
        self._norms = np.full((capacity, len(self.layers)), np.nan, dtype=np.float32)
        self._logged = np.zeros(capacity, dtype=bool)
        self._next = 0
        self._newest = -1  # the last step kept
        self._action = action
        self._last_window: dict[str, int] = {}  # per incident kind: its last window's step
        self._sent_until = -1  # the steps up to here went out in a window already
        self.windows_sent = 0

    @property
    def capacity(self) -> int:
        """Steps the host copy holds: ``steps + 1 + slack``."""
        return len(self._step)

    def add(self, rows: np.ndarray | None) -> None:
        """Keep the steps a hand-off carried: the ring's rows ``[step, *layer norms]``, flat.
        Rows of steps kept already (a held ring hands them on again) are dropped."""
        if rows is None or len(rows) == 0:
            return
        rows = rows.reshape(-1, 1 + len(self.layers))
        steps = rows[:, 0].astype(np.int64)
        fresh = steps > self._newest
        if not fresh.any():
            return
        steps, rows = steps[fresh], rows[fresh]
        capacity = self.capacity
        for step, row in zip(steps[-capacity:].tolist(), rows[-capacity:, 1:]):
            slot = self._next % capacity
            self._step[slot], self._norms[slot], self._logged[slot] = step, row, False
            self._next += 1
        self._newest = int(steps[-1])

    def ending(self, outcome: str, step: int, wall_time: float) -> StepRecord | None:
        """Training ended in an exception (``FAILED``) or Ctrl-C (``KILLED``) at ``step``:
        a record that carries only the window before it, if one is due."""
        window = self.window(outcome, step)
        if window is None:
            return None
        if window.message:
            report(f"gradtrack: training ended ({outcome}) at step {step}; {window.message}")
        return StepRecord(
            step=step, wall_time=wall_time, layers=(), stats=np.zeros((0, TENSOR_COLUMNS + 2)),
            total_norm=float("nan"), layer_detail="none", counted=False, flight=window,
            window_only=True,
        )  # fmt: skip

    def annotate(
        self, records: list[StepRecord], events: list[AlertEvent]
    ) -> tuple[list[StepRecord], list[AlertEvent]]:
        """Mark the steps whose per-layer norms went out already; at an incident, put its
        window on its record and name the first mover in its event."""
        for record in records:
            if record.per_layer:
                self._logged[self._step == record.step] = True
        found = self._incident(records, events)
        if found is None:
            return records, events
        step, incident, event_index = found
        window = self.window(incident, step)
        if window is None:
            return records, events
        records = [replace(r, flight=window) if r.step == step else r for r in records]
        if not any(r.flight is window for r in records):
            records[-1] = replace(records[-1], flight=window)
        if event_index is not None and window.first_mover is not None:
            event = events[event_index]
            events = list(events)
            events[event_index] = event.model_copy(
                update={
                    "message": f"{event.message} {window.message}",
                    "first_mover": window.first_mover,
                    "first_mover_step": window.first_mover_step,
                }
            )
        return records, events

    def _incident(
        self, records: list[StepRecord], events: list[AlertEvent]
    ) -> tuple[int, str, int | None] | None:
        """(step, what, index of its event) of the first incident among a step's items."""
        for i, event in enumerate(events):
            if event.severity == "info":
                continue
            action = self._action(event.rule, event.layer)
            if event.rule in INCIDENT_RULES or action in ("raise", "skip"):
                return event.step, event.rule, i
        for record in records:
            if record.skipped_by is not None:
                return record.step, record.skipped_by, None
        return None

    def window(self, incident: str, step: int) -> FlightWindow | None:
        """The window of an incident at ``step``: it and the ``steps`` steps before it; steps
        a window sent already are marked ``logged`` (a step's norms go out once). None if an
        incident of the same kind (for the end of training: of any kind) sent one less than
        ``steps`` steps before (a run that stays broken would send one per event), or no
        step is kept."""
        ending = incident in ("FAILED", "KILLED")  # after any incident's window: none more
        last = max(self._last_window.values(), default=None) if ending else None
        last = self._last_window.get(incident, last)
        if last is not None and step - last < self.steps:
            return None
        keep = (self._step >= 0) & (self._step <= step) & (self._step >= step - self.steps)
        order = np.flatnonzero(keep)[np.argsort(self._step[keep], kind="stable")]
        if len(order) == 0:
            return None
        self._last_window[incident] = step
        self.windows_sent += 1
        steps, norms = self._step[order].copy(), self._norms[order].copy()
        logged = self._logged[order] | (steps <= self._sent_until)
        self._sent_until = max(self._sent_until, step)
        window = FlightWindow(incident, step, self.layers, steps, norms, logged)
        move = first_mover(steps, norms, step)
        if move is None:
            return window
        what = _WHAT.get(incident, f"the {incident} incident")
        if incident in ("FAILED", "KILLED"):
            what = "training ended" + (" (interrupted)" if incident == "KILLED" else "")
        layer = self.layers[move.layer]
        return replace(
            window, first_mover=layer, first_mover_step=move.step,
            first_mover_direction=move.direction,
            message=first_mover_sentence(layer, move.step, move.direction, what, step),
        )  # fmt: skip
