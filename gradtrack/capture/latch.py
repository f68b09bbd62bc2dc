"""On accelerators: the first non-finite step between two logged steps, kept on the device.

Reading the guard's verdict at every step would wait for the device; instead a few tiny
kernels per step remember the first bad step and its gradient norms, and the next logged
step carries them to the host in its one copy.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from gradtrack.capture.collect import Guard
from gradtrack.capture.stats import DeviceIndex


class BadStepLatch:
    """The step number and per-tensor L2 norms of the first bad step since the last `take`
    — non-finite, or spiking (`gradtrack.capture.spike`) — as one float64 tensor
    ``[step, *norms, *spike]`` on the model's (first) device; -1 for no step yet and for
    tensors without a gradient at that step; ``spike`` the step's spike vector (``spike_size``
    values, none without the spike rule)."""

    def __init__(self, n_tensors: int, spike_size: int = 0) -> None:
        self.n_tensors = n_tensors
        self.size = 1 + n_tensors + spike_size
        self._state: Tensor | None = None
        self._index = DeviceIndex()
        self.holding: Tensor | None = None  # see `update`

    def update(self, guard: Guard, step: int, spike: Tensor | None = None) -> None:
        """Latch this step if it is the first bad one: no host read, no branch."""
        part = guard.devices[0]  # (a model spread over devices is latched on its first)
        state = self._state_on(part.device)
        bad = ~torch.isfinite(part.l2).all()
        if spike is not None:
            bad = bad | spike_flagged(spike)
        empty = state[0] < 0
        self.holding = ~empty  # a bad step latched before this one
        fresh = torch.logical_and(bad, empty)
        if spike is not None:
            tail = state[1 + self.n_tensors :]
            tail.copy_(torch.where(fresh, spike, tail))
        state[0] = torch.where(fresh, float(step), state[0])
        index = self._index(part.index, part.device) + 1
        state[index] = torch.where(fresh, part.l2, state[index])

    def take(self, device: torch.device) -> Tensor:
        """The latch, for a logged step's host copy; the next step starts a fresh one (in
        place would race with the copy, which runs later in the device's stream)."""
        state, self._state, self.holding = self._state_on(device), None, None
        return state

    def read(self) -> np.ndarray | None:
        """The latch read on the host (a wait for the device: for the end of training only);
        None if no step was latched since the last take."""
        state, self._state, self.holding = self._state, None, None
        if state is None:
            return None
        flags = state.cpu().numpy()
        return None if flags[0] < 0 else flags

    def _state_on(self, device: torch.device) -> Tensor:
        if self._state is None:  # made on the device: a copy from the host could wait
            self._state = torch.full((self.size,), -1.0, dtype=torch.float64, device=device)
        return self._state


def spike_flagged(spike: Tensor) -> Tensor:
    """Whether any column of a `gradtrack.capture.spike.NormWindow` vector spiked (on the
    device)."""
    return spike[2 * (len(spike) // 3) :].any()
