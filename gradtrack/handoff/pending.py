"""A step as the training thread hands it to the worker (`PendingStep`); the worker's answer
to a step judged before its optimizer step (`Reply`); and the update that step then applied
(`UpdateFollowUp`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradtrack.formats.event import AlertEvent
from gradtrack.handoff.layout import HostPart

# `UpdateProbe.after`'s per-tensor rows on the host, and their copy's event.
UpdateRows = tuple[Tensor, torch.cuda.Event | None]


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
    update: UpdateRows | None = None
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
    # A raise rule judges it before its optimizer step: the worker answers here.
    reply: Reply | None = None
    # Its update signals follow once the optimizer step ran (an `UpdateFollowUp`).
    expects_update: bool = False


class Reply:
    """The worker's judgement of one step a raise rule waits for: the first event whose rule
    raises (None: none does), or that it could not judge the step."""

    def __init__(self) -> None:
        self.event: AlertEvent | None = None
        self.judged = False
        self._done = threading.Event()

    def answer(self, event: AlertEvent | None) -> None:
        self.event, self.judged = event, True
        self._done.set()

    def fail(self) -> None:
        self._done.set()

    def wait(self, timeout_s: float, gone: Callable[[], bool]) -> bool:
        """Wait for the answer, no longer than ``timeout_s`` and not once ``gone()`` says the
        worker stopped; True if the step was judged."""
        deadline = time.monotonic() + timeout_s
        while not self._done.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            if gone() or time.monotonic() >= deadline:
                break
        return self.judged


@dataclass
class UpdateFollowUp:
    """The update a judged step's optimizer step applied (None: it did not run), for the
    worker to add to that step's record before it is delivered."""

    step: int
    update: UpdateRows | None = field(default=None)
