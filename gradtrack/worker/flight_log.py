"""The flight recorder on the worker: the steps the training thread's ring handed on, kept on
the host, and the window an incident sends — once, on the incident's record, with its first
mover named in the incident's event.

An incident is a ``nonfinite``, ``spike`` or ``exploding`` event, any event whose rule
raises or skips, a skipped step, or training that ended in an exception or Ctrl-C.

The first mover (`first_mover`, pure numpy): the layer whose gradient norm left its own
running range first in the steps before the incident, and the step its move began.

Each layer's range is its median and spread (MAD) of log10 norms over the window's steps
before the incident: robust to the move itself, which takes a minority of the window. A
layer has moved where it stays out of that range (``z`` spreads and at least ``margin``
decades) from some step to the incident; its move began where it last sat inside one
spread of its median before that. The earliest beginning names the first mover.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from gradtrack.formats.event import AlertEvent
from gradtrack.formats.flight import FlightWindow
from gradtrack.formats.record import StepRecord
from gradtrack.handoff.layout import TENSOR_COLUMNS
from gradtrack.log import report

# A move must leave the range by this many spreads and decades, and stay out until the
# incident; the spread is read as at least _MIN_SPREAD (a fixed batch's norms barely vary).
Z = 4.0
MARGIN_DECADES = 0.1
_MIN_SPREAD = 0.01
# Fewer steps than this before the incident give no range to leave.
MIN_STEPS = 24


class FirstMove(NamedTuple):
    layer: int  # column of the window
    step: int  # the step its move began
    direction: str  # "rising" or "falling"


def first_mover(steps: np.ndarray, norms: np.ndarray, incident_step: int) -> FirstMove | None:
    """The layer that moved first before ``incident_step``; None if none left its range.

    >>> rng = np.random.default_rng(0)
    >>> norms = 10 ** rng.normal(0, 0.02, (100, 3))
    >>> norms[70:, 1] *= 1.2 ** np.arange(1, 31)  # layer 1 grows from step 70
    >>> first_mover(np.arange(100), norms, incident_step=100)
    FirstMove(layer=1, step=70, direction='rising')
    """
    before = np.asarray(steps) < incident_step
    x = _log_norms(np.asarray(norms, dtype=np.float64)[before])
    step_of = np.asarray(steps)[before]
    if len(x) < MIN_STEPS:
        return None
    with np.errstate(invalid="ignore"):
        median = np.nanmedian(x, axis=0)
        spread = 1.4826 * np.nanmedian(np.abs(x - median), axis=0)
    spread = np.where(np.isfinite(spread), np.maximum(spread, _MIN_SPREAD), np.nan)
    deviation = (x - median) / spread
    best: FirstMove | None = None
    for layer in range(x.shape[1]):
        move = _move(deviation[:, layer], x[:, layer] - median[layer])
        if move is None:
            continue
        began, direction = move
        if best is None or step_of[began] < best.step:
            best = FirstMove(layer, int(step_of[began]), direction)
    return best


def _log_norms(norms: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.log10(norms)
    return np.where(np.isfinite(x), x, np.nan)


def _move(deviation: np.ndarray, offset: np.ndarray) -> tuple[int, str] | None:
    """(index where the move began, its direction) of one layer, or None if it did not
    stay out of its range up to the incident."""
    if len(deviation) == 0 or not np.isfinite(deviation[-1]):
        return None
    sign = 1.0 if deviation[-1] > 0 else -1.0
    with np.errstate(invalid="ignore"):
        out = (sign * deviation > Z) & (sign * offset > MARGIN_DECADES)
    if not out[-1]:
        return None
    inside = np.flatnonzero(~out)
    crossed = int(inside[-1]) + 1 if len(inside) else 0  # out from here to the incident
    with np.errstate(invalid="ignore"):
        calm = np.flatnonzero(~(sign * deviation[:crossed] > 1.0))
    began = int(calm[-1]) + 1 if len(calm) else 0
    return began, "rising" if sign > 0 else "falling"


def first_mover_sentence(layer: str, step: int, direction: str, what: str, at: int) -> str:
    """The sentence an incident's event ends with.

    >>> first_mover_sentence("conv2", 488, "rising", "the NaN", 517)
    "conv2's gradient norm began rising at step 488, 29 steps before the NaN at step 517."
    """
    gap = at - step
    return (
        f"{layer}'s gradient norm began {direction} at step {step}, {gap} step"
        f"{'' if gap == 1 else 's'} before {what} at step {at}."
    )


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
        capacity = self.capacity
        steps, rows = steps[fresh][-capacity:], rows[fresh][-capacity:]
        slots = (self._next + np.arange(len(steps))) % capacity
        self._step[slots], self._norms[slots], self._logged[slots] = steps, rows[:, 1:], False
        self._next += len(steps)
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
            step=step,
            wall_time=wall_time,
            layers=(),
            stats=np.zeros((0, TENSOR_COLUMNS + 2)),
            total_norm=float("nan"),
            layer_detail="none",
            counted=False,
            flight=window,
            window_only=True,
        )

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
            window,
            first_mover=layer,
            first_mover_step=move.step,
            first_mover_direction=move.direction,
            message=first_mover_sentence(layer, move.step, move.direction, what, step),
        )
