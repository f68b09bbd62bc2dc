"""Spike statistics, every step, on the device: z-scores of the total and per-layer gradient
norms against a window of recent steps, so that a spike between logged steps is seen at its step.

Norms are compared on a log scale (a norm's spread is multiplicative, and a ×300 jump is the
same finding at any magnitude). Nothing here reads a value back to the host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradtrack.capture.collect import Guard
from gradtrack.capture.stats import DeviceIndex

# A window whose spread is below this (in decades) is read as this: identical norms (a fixed
# batch) must not make a 1e-12 wobble a spike. The ``ratio`` floor guards the same way.
_MIN_STD_DECADES = 1e-3


def on_host(guard: Guard) -> bool:
    """Whether the step's statistics run in numpy: CPU gradients, where the guard's norms are
    host memory already and numpy's ~1 µs per operation beats torch's ~10 µs; accelerators
    (and the foreach path tests take for them) keep them on the device."""
    part = guard.devices[0]
    return part.device.type == "cpu" and not part.foreach_only


class LayerNorms:
    """float64 ``[1 + layers]``: a step's total and per-layer L2 norms from its guard's tensor
    norms (0 for a layer without a gradient), on the guard's device. No host read."""

    def __init__(self, tensor_layer: np.ndarray, n_layers: int) -> None:
        self.columns = 1 + n_layers
        self._tensor_layer = tensor_layer
        self._index = DeviceIndex()
        self._rows: np.ndarray | None = None
        self._columns = np.zeros(0, dtype=np.int64)

    def __call__(self, guard: Guard) -> Tensor:
        part = guard.devices[0]  # (a model spread over devices is judged on its first)
        if part.index is not self._rows:  # (the layout's rows: the same array step after step)
            self._rows, self._columns = part.index, self._tensor_layer[part.index] + 1
        columns = self._columns
        if on_host(guard):
            l2 = part.l2.numpy()
            with np.errstate(over="ignore", invalid="ignore"):
                host = np.bincount(columns, weights=l2 * l2, minlength=self.columns)
                host[0] = host[1:].sum()
            return torch.from_numpy(np.sqrt(host))
        squares = torch.zeros(self.columns, dtype=torch.float64, device=part.device)
        squares.index_add_(0, self._index(columns, part.device), part.l2 * part.l2)
        squares[0] = squares[1:].sum()
        return squares.sqrt()


class NormWindow:
    """Running mean and variance of log10 norms over the last ``window`` steps, per column:
    column 0 the total norm, column ``1 + i`` layer ``i``.

    Per step, `update` returns ``[z (C), typical norm (C), spiking 0/1 (C)]`` as one float64
    tensor (``3 * C``) where the norms are: a column spikes when its z-score is above ``z``
    and its norm above ``ratio`` × the window's typical (geometric-mean) norm, once ``warmup``
    steps are in its window. A spiking value enters the window clipped to the threshold, so
    one spike barely moves the statistics while a lasting change of regime is taken in over
    time. Absent (zero) and non-finite norms do not enter it.
    """

    def __init__(
        self,
        n_layers: int,
        window: int,
        warmup: int,
        z: Sequence[float],
        ratio: Sequence[float],
        enabled: Sequence[bool],
    ) -> None:
        self.columns = 1 + n_layers
        self.size = 3 * self.columns
        self.window = window
        self.warmup = warmup
        self._z = np.asarray(z, dtype=np.float64)
        self._log_ratio = np.log10(np.asarray(ratio, dtype=np.float64))
        self._enabled = np.asarray(enabled, dtype=bool)
        self._position = 0
        self._state: dict[str, Any] = {}

    def _state_for(self, norms: Tensor, host: bool) -> dict[str, Any]:
        if not self._state or isinstance(self._state["sums"], np.ndarray) != host:
            c = self.columns
            state = {
                # (x, x², 1) per step in the window; 0 where a column took nothing
                "rows": np.zeros((self.window, 3, c)),
                "sums": np.zeros((3, c)),
                "z": self._z,
                "log_ratio": self._log_ratio,
                "enabled": self._enabled,
            }
            # made on the device once: a copy from the host at every step could wait
            self._state = state if host else {
                key: torch.as_tensor(value, device=norms.device) for key, value in state.items()
            }  # fmt: skip
        return self._state

    def update(self, norms: Tensor, host: bool = False) -> Tensor:
        """Judge this step's norms against the window, then add them to it. ``host``: in
        numpy, on the CPU tensor's memory (see `on_host`)."""
        state = self._state_for(norms, host)
        if not host:
            return self._step(torch, norms, state)
        with np.errstate(divide="ignore", invalid="ignore"):
            return torch.from_numpy(self._step(np, norms.numpy(), state))

    def _step(self, xp: Any, norms: Any, state: dict[str, Any]) -> Any:
        """The window's arithmetic, written once for ``xp`` = numpy or torch."""
        sums, rows = state["sums"], state["rows"]
        # (numpy's clip is ~10x its maximum; torch's maximum wants a tensor)
        at_least: Any = np.maximum if xp is np else torch.clamp_min
        x = xp.log10(norms)
        present = xp.isfinite(x)  # an absent layer (norm 0) or a non-finite step: skipped
        count = sums[2]
        mean = sums[0] / at_least(count, 1)
        spread = at_least(sums[1] / at_least(count, 1) - mean * mean, 0)
        std = at_least(xp.sqrt(spread), _MIN_STD_DECADES)
        z = (x - mean) / std
        spiking = present & state["enabled"] & (count >= self.warmup)
        spiking &= (z > state["z"]) & (x - mean > state["log_ratio"])
        taken = xp.where(spiking, mean + state["z"] * std, x)
        row = xp.where(present, xp.stack([taken, taken * taken, xp.ones_like(x)]), 0.0)
        slot = self._position % self.window
        self._position += 1
        sums += row - rows[slot]
        rows[slot] = row
        typical = xp.where(count < 1, math.nan, 10.0**mean)
        z = xp.where(present & (count >= 1), z, math.nan)
        return xp.concatenate([z, typical, spiking * 1.0])
