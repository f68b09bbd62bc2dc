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

from gradtrack.collect import Guard
from gradtrack.stats import DeviceIndex

# A window whose spread is below this (in decades) is read as this: identical norms (a fixed
# batch) must not make a 1e-12 wobble a spike. The ``ratio`` floor guards the same way.
_MIN_STD_DECADES = 1e-3


class LayerNorms:
    """float64 ``[1 + layers]`` on the device: a step's total and per-layer L2 norms from its
    guard's tensor norms (0 for a layer without a gradient). One scatter, no host read."""

    def __init__(self, tensor_layer: np.ndarray, n_layers: int) -> None:
        self.columns = 1 + n_layers
        self._tensor_layer = tensor_layer
        self._index = DeviceIndex()

    def __call__(self, guard: Guard) -> Tensor:
        part = guard.devices[0]  # (a model spread over devices is judged on its first)
        squares = torch.zeros(self.columns, dtype=torch.float64, device=part.device)
        columns = self._index(self._tensor_layer[part.index] + 1, part.device)
        squares.index_add_(0, columns, part.l2 * part.l2)
        squares[0] = squares[1:].sum()
        return squares.sqrt()


class NormWindow:
    """Running mean and variance of log10 norms over the last ``window`` steps, per column:
    column 0 the total norm, column ``1 + i`` layer ``i``.

    Per step, `update` returns ``[z (C), typical norm (C), spiking 0/1 (C)]`` as one float64
    device tensor (``3 * C``): a column spikes when its z-score is above ``z`` and its norm
    above ``ratio`` × the window's typical (geometric-mean) norm, once ``warmup`` steps are in
    its window. A spiking value enters the window clipped to the threshold, so one spike
    barely moves the statistics while a lasting change of regime is taken in over time.
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
        self._state: dict[str, Tensor] = {}

    def _on(self, device: torch.device) -> dict[str, Tensor]:
        if not self._state:  # made on the device once: a copy from the host could wait
            c, f64 = self.columns, torch.float64
            self._state = {
                # (x, x², 1) per step in the window, 0 where a column took nothing
                "rows": torch.zeros(self.window, 3, c, dtype=f64, device=device),
                "sums": torch.zeros(3, c, dtype=f64, device=device),
                "z": torch.as_tensor(self._z, dtype=f64, device=device),
                "log_ratio": torch.as_tensor(self._log_ratio, dtype=f64, device=device),
                "enabled": torch.as_tensor(self._enabled, device=device),
            }
        return self._state

    def update(self, norms: Tensor) -> Tensor:
        """Judge this step's norms against the window, then add them to it."""
        state = self._on(norms.device)
        sums, rows = state["sums"], state["rows"]
        x = norms.log10()
        present = torch.isfinite(x)  # an absent layer (norm 0) or a non-finite step: skipped
        count = sums[2]
        mean = sums[0] / count.clamp_min(1)
        std = (sums[1] / count.clamp_min(1) - mean * mean).clamp_min(0).sqrt()
        std = std.clamp_min(_MIN_STD_DECADES)
        z = (x - mean) / std
        spiking = present & state["enabled"] & (count >= self.warmup)
        spiking &= (z > state["z"]) & (x - mean > state["log_ratio"])
        taken = torch.where(spiking, mean + state["z"] * std, x)
        row = torch.stack([taken, taken * taken, torch.ones_like(x)]) * present
        slot = self._position % self.window
        self._position += 1
        sums += row - rows[slot]
        rows[slot] = row
        typical = torch.pow(10.0, mean).masked_fill(count < 1, math.nan)
        z = z.masked_fill(~present | (count < 1), math.nan)
        return torch.cat([z, typical, spiking.double()])


def spike_fields(vector: np.ndarray) -> dict[str, Any]:
    """`StepRecord` fields from a `NormWindow.update` vector read on the host.

    >>> fields = spike_fields(np.array([1.0, 9.0, 2.0, 3.0, 0.0, 1.0]))
    >>> fields["spike_z"].tolist(), fields["spiking"].tolist()
    ([1.0, 9.0], [False, True])
    """
    z, typical, spiking = np.split(vector, 3)
    return {"spike_z": z, "spike_typical": typical, "spiking": spiking > 0}
