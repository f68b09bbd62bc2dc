"""A step as the training thread hands it to the worker (`PendingStep`), and what the
worker makes of it (`AssembledStep`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord
from gradtrack.handoff.layout import HostPart


@dataclass
class PendingStep:
    """A step as the training thread left it: device work launched, copies in flight."""

    step: int
    wall_time: float
    parts: list[HostPart]
    backward_order: list[int] | None = None  # layer indices, once learnt
    activation_order: list[int] | None = None  # activation modules, as their grads arrived
    # Sinks write its per-layer metrics (``layer_every``), and max/mean |g| were computed.
    per_layer: bool = True
    # A non-finite step: `StepRecord` fields from `gradtrack.capture.origin` (where it was made).
    origin: dict[str, Any] | None = None
    # With ``update_signals``: `UpdateProbe.after`'s rows on the host, and their copy's event.
    update: tuple[Tensor, torch.cuda.Event | None] | None = None
    # The rule whose action "skip" left this step's optimizer step out; skips so far.
    skipped_by: str | None = None
    skipped_steps: int = 0
    # The closing step's flight recorder rows (a logged step's ride in its evidence).
    flight_rows: np.ndarray | None = None
    # The closing step's: how training ended where that was an exception or Ctrl-C, and the
    # bad step the accelerator's guard latched after the last logged step, read at close.
    ending: str | None = None
    latch: np.ndarray | None = None
    # The noise scale's: the step's examples counted (0: not) and its backward passes.
    batch: tuple[int, int] = (0, 1)


@dataclass
class AssembledStep:
    """A step's records and alerts: one record, led by the latched bad step before it when
    an accelerator's guard latched one (see `gradtrack.capture.latch`)."""

    records: list[StepRecord]
    events: list[AlertEvent]
    # Judged before its optimizer step (a raise rule), then held for the update it applied:
    # the worker adds that update's signals to the last record.
    update: tuple[Tensor, torch.cuda.Event | None] | None = None
