"""The flight recorder's ring on the training thread: every step's per-layer norms (from the
guard's, `gradtrack.spike.LayerNorms`) written into one slot of a ``[K, layers]`` float32
ring on the model's device — one small copy per step, no host read, no per-layer host work.

The steps since the last hand-off ride to the worker in the next summarised step's one host
copy (`StepEvidence.flight`); the worker keeps them (`gradtrack.flight_log`) and sends the
window when an incident fires, so nothing flows back to this thread.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

OnError = Callable[[int, Exception], None]


class FlightRecorder:
    """The last ``capacity`` steps' layer norms, on the device of the norms it is given.

    >>> recorder = FlightRecorder(capacity=4, n_layers=2)
    >>> for step in range(6):
    ...     recorder.record(step, torch.tensor([9.0, step, -step], dtype=torch.float64))
    >>> steps, norms = recorder.take()
    >>> steps.tolist(), norms.reshape(-1, 2)[:, 0].tolist()
    ([2, 3, 4, 5], [2.0, 3.0, 4.0, 5.0])
    >>> recorder.take() is None  # nothing new since
    True
    """

    def __init__(self, capacity: int, n_layers: int) -> None:
        self.capacity = capacity
        self.n_layers = n_layers
        self._ring: Tensor | None = None
        self._steps = np.full(capacity, -1, dtype=np.int64)  # host: the step of each slot
        self._written = 0  # slots written so far (the next one is ``_written % capacity``)
        self._handed = 0  # ... of which handed to the worker

    @property
    def nbytes(self) -> int:
        """Device memory the ring takes: capacity × layers × 4 bytes."""
        return self.capacity * self.n_layers * 4

    def record(self, step: int, norms: Tensor | None, on_error: OnError | None = None) -> None:
        """Keep one step's norms (``[1 + layers]``: the total first, as `LayerNorms` gives;
        None: the step has none). A failure goes to ``on_error``: training goes on."""
        if norms is None:
            return
        try:
            self._record(step, norms)
        except Exception as exc:  # watching must never crash training
            if on_error is None:
                raise
            on_error(step, exc)

    def _record(self, step: int, norms: Tensor) -> None:
        if self._ring is None or self._ring.device != norms.device:
            self._ring = torch.full(
                (self.capacity, self.n_layers), float("nan"), dtype=torch.float32,
                device=norms.device,
            )  # fmt: skip
        slot = self._written % self.capacity
        self._ring[slot].copy_(norms[1:], non_blocking=True)
        self._steps[slot] = step
        self._written += 1

    def take(self) -> tuple[np.ndarray, Tensor] | None:
        """The steps written since the last take (at most ``capacity``, oldest first) and
        their norms as one flat float64 tensor on the ring's device (a copy: the ring goes
        on); None if there are none."""
        count = min(self._written - self._handed, self.capacity)
        self._handed = self._written
        if count == 0 or self._ring is None:
            return None
        end = self._written % self.capacity
        start = (end - count) % self.capacity
        if start < end:
            rows, steps = self._ring[start:end], self._steps[start:end]
        else:  # wrapped around
            rows = torch.cat([self._ring[start:], self._ring[:end]])
            steps = np.concatenate([self._steps[start:], self._steps[:end]])
        return steps.copy(), rows.to(torch.float64).reshape(-1)

    def take_on_host(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """`take`, read on the host (a wait for the device: for the end of training only)."""
        taken = self.take()
        return (None, None) if taken is None else (taken[0], taken[1].cpu().numpy())
