"""On accelerators: the first non-finite step between two logged steps, kept on the device.

Reading the guard's verdict at every step would wait for the device; instead a few tiny
kernels per step remember the first bad step and its gradient norms, and the next logged
step carries them to the host in its one copy.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from gradtrack.collect import Guard
from gradtrack.stats import DeviceIndex


class BadStepLatch:
    """The step number and per-tensor L2 norms of the first non-finite step since the last
    `take`, as one float64 tensor ``[step, *norms]`` on the model's (first) device; -1 for
    no step yet and for tensors without a gradient at that step."""

    def __init__(self, n_tensors: int) -> None:
        self.size = 1 + n_tensors
        self._state: Tensor | None = None
        self._index = DeviceIndex()

    def update(self, guard: Guard, step: int) -> None:
        """Latch this step if it is the first non-finite one: no host read, no branch."""
        part = guard.devices[0]  # (a model spread over devices is latched on its first)
        state = self._state_on(part.device)
        fresh = torch.logical_and(~torch.isfinite(part.l2).all(), state[0] < 0)
        state[0] = torch.where(fresh, float(step), state[0])
        index = self._index(part.index, part.device) + 1
        state[index] = torch.where(fresh, part.l2, state[index])

    def take(self, device: torch.device) -> Tensor:
        """The latch, for a logged step's host copy; the next step starts a fresh one (in
        place would race with the copy, which runs later in the device's stream)."""
        state, self._state = self._state_on(device), None
        return state

    def _state_on(self, device: torch.device) -> Tensor:
        if self._state is None:  # made on the device: a copy from the host could wait
            self._state = torch.full((self.size,), -1.0, dtype=torch.float64, device=device)
        return self._state


def latched_step(flags: np.ndarray) -> tuple[int, np.ndarray] | None:
    """(step, per-tensor norms, -1 where absent) from a latch read on the host; None if
    no step was bad.

    >>> latched_step(np.array([-1.0, -1.0, -1.0]))
    >>> latched_step(np.array([7.0, 1.5, np.nan]))
    (7, array([1.5, nan]))
    """
    if len(flags) == 0 or flags[0] < 0:
        return None
    return int(flags[0]), flags[1:]
