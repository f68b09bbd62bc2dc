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

from gradtrack.capture.collect import DeviceGrads, Guard
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
        if on_host(guard):
            with np.errstate(over="ignore", invalid="ignore"):
                return torch.from_numpy(self.on_host(part))
        squares = torch.zeros(self.columns, dtype=torch.float64, device=part.device)
        squares.index_add_(0, self._index(self._columns_of(part), part.device), part.l2 * part.l2)
        squares[0] = squares[1:].sum()
        return squares.sqrt()

    def on_host(self, part: DeviceGrads) -> np.ndarray:
        """`__call__` in numpy, for CPU gradients (the caller holds numpy's error state: a
        norm's square may overflow)."""
        l2 = part.l2.numpy()
        host = np.bincount(self._columns_of(part), weights=l2 * l2, minlength=self.columns)
        host[0] = host[1:].sum()
        return np.sqrt(host, out=host)

    def _columns_of(self, part: DeviceGrads) -> np.ndarray:
        if part.index is not self._rows:  # (the layout's rows: the same array step after step)
            self._rows, self._columns = part.index, self._tensor_layer[part.index] + 1
        return self._columns


_HOST = np.empty(0)  # (what `_state_for` is given where the state lives on the host)

# Steps whose norms wait before they enter the window (see `NormWindow`): the window's
# arithmetic, ~25 operations, then runs once per this many steps instead of every step.
REFRESH = 32


class NormWindow:
    """Running mean and variance of log10 norms over the last ``window`` steps, per column:
    column 0 the total norm, column ``1 + i`` layer ``i``.

    Per step, `update` returns ``[z (C), typical norm (C), spiking 0/1 (C)]`` as one float64
    tensor (``3 * C``) where the norms are: a column spikes when its z-score is above ``z``
    and its norm above ``ratio`` × the window's typical (geometric-mean) norm, once ``warmup``
    steps are in its window. A spiking value enters the window clipped to the threshold, so
    one spike barely moves the statistics while a lasting change of regime is taken in over
    time. Absent (zero) and non-finite norms do not enter it.

    The statistics are refreshed every ``refresh`` steps: a step is judged against the window
    of ``window`` steps that ended at the last refresh (at most ``refresh - 1`` steps before
    it), so that a step pays ~10 operations — its z-scores and one comparison with the
    thresholds — and the window's update runs once per ``refresh`` steps, for all of them.
    """

    def __init__(
        self,
        n_layers: int,
        window: int,
        warmup: int,
        z: Sequence[float],
        ratio: Sequence[float],
        enabled: Sequence[bool],
        refresh: int = REFRESH,
    ) -> None:
        self.columns = 1 + n_layers
        self.size = 3 * self.columns
        self.window = window
        self.warmup = warmup
        self.refresh = max(1, min(refresh, window, warmup))  # (armed by the end of its warmup)
        self._z = np.asarray(z, dtype=np.float64)
        self._log_ratio = np.log10(np.asarray(ratio, dtype=np.float64))
        self._enabled = np.asarray(enabled, dtype=bool)
        self._position = 0  # steps taken into the window so far
        self._waiting = 0  # steps judged since the last refresh
        # Their norms, where the window lives on the host: a list append costs a step less
        # than a write into a numpy row (~5 µs inside a training step, numpy's caches cold).
        self._host_waiting: list[np.ndarray | list[float]] = []
        self._state: dict[str, Any] = {}
        self._limits: list[float] | None = None  # ``limit_norm`` as floats, for `quiet_values`
        # ``mean``, ``inv_std`` and ``typical`` as floats, for `vector_values`
        self._stats: tuple[list[float], list[float], list[float]] | None = None

    def _state_for(self, norms: Tensor | np.ndarray, host: bool) -> dict[str, Any]:
        if not self._state or isinstance(self._state["sums"], np.ndarray) != host:
            c = self.columns
            state = {
                # (x, x², 1) per step in the window; 0 where a column took nothing
                "rows": np.zeros((self.window, 3, c)),
                "sums": np.zeros((3, c)),
                "z": self._z,
                "log_ratio": self._log_ratio,
                "enabled": self._enabled,
                # the thresholds of an empty window (see `_refresh`)
                "mean": np.zeros(c),
                "inv_std": np.full(c, np.nan),
                "typical": np.full(c, np.nan),
                "limit": np.full(c, np.inf),
                "limit_norm": np.full(c, np.inf),  # 10 ** limit: a quiet step's test
                "clip": np.zeros(c),
            }
            if host:  # (the norms judged since a refresh wait in `_host_waiting`)
                self._state = state
            else:  # made on the device once: a copy from the host at every step could wait
                state["waiting"] = np.zeros((self.refresh, c))  # the norms judged since
                self._state = {
                    key: torch.as_tensor(value, device=norms.device) for key, value in state.items()
                }
            self._position = self._waiting = 0
            self._host_waiting = []
            self._limits = self._stats = None
        return self._state

    def update(self, norms: Tensor, host: bool = False) -> Tensor:
        """Judge this step's norms against the window; they enter it at the next refresh.
        ``host``: in numpy, on the CPU tensor's memory (see `on_host`)."""
        state = self._state_for(norms, host)
        if not host:
            return self._step(torch, norms, state)
        with np.errstate(divide="ignore", invalid="ignore"):
            return torch.from_numpy(self._step(np, norms.numpy(), state))

    def on_host(self, norms: np.ndarray) -> np.ndarray:
        """`update` in numpy, on host norms (the caller holds numpy's error state: the log of
        an absent layer's 0)."""
        return self._step(np, norms, self._state_for(norms, True))

    def quiet(self, norms: np.ndarray) -> bool:
        """A step's finite host norms taken into the window where no column spikes (True);
        False leaves the window as it was, for `on_host` to judge the step in full. Two
        operations: what a healthy step between logged ones costs."""
        state = self._state_for(norms, True)
        if (norms > state["limit_norm"]).any():
            return False
        self._take(np, norms, state)
        return True

    def vector_values(self, norms: list[float]) -> list[float]:
        """`on_host`'s vector for a step whose norms (Python floats, finite) spike in no
        column, before `quiet_values` takes them: each column's z-score (NaN where its norm
        is 0), the typical norms, and no column spiking."""
        self._state_for(_HOST, True)
        stats = self._stats
        if stats is None:
            state = self._state
            stats = self._stats = (
                state["mean"].tolist(),
                state["inv_std"].tolist(),
                state["typical"].tolist(),
            )
        mean, inv_std, typical = stats
        z = [
            (math.log10(norm) - m) * s if norm > 0.0 else math.nan
            for norm, m, s in zip(norms, mean, inv_std)
        ]
        return z + typical + [0.0] * len(norms)

    def quiet_values(self, norms: list[float]) -> bool:
        """`quiet` for a small model's norms as Python floats: on a handful of columns a
        comparison per column in Python costs less than numpy's calls (each ~10 µs inside a
        training step, its caches cold)."""
        limits = self._limits
        if limits is None:
            limits = self._limits = self._state_for(_HOST, True)["limit_norm"].tolist()
        for norm, limit in zip(norms, limits):
            if norm > limit:
                return False
        if self._waiting + 1 < self.refresh:  # (`_take`, but for the refresh)
            self._host_waiting.append(norms)
            self._waiting += 1
        else:
            self._take(np, norms, self._state)
        return True

    def _step(self, xp: Any, norms: Any, state: dict[str, Any]) -> Any:
        """One step's judgement, written once for ``xp`` = numpy or torch."""
        x = xp.log10(norms)
        present = xp.isfinite(x)  # an absent layer (norm 0) or a non-finite step: skipped
        spiking = (x > state["limit"]) & present
        z = xp.where(present, (x - state["mean"]) * state["inv_std"], math.nan)
        vector = xp.concatenate([z, state["typical"], spiking * 1.0])
        self._take(xp, norms, state)
        return vector

    def _take(self, xp: Any, norms: Any, state: dict[str, Any]) -> None:
        if xp is np:  # (a copy of an array: the caller may hand it on)
            self._host_waiting.append(norms.copy() if isinstance(norms, np.ndarray) else norms)
        else:
            state["waiting"][self._waiting] = norms
        self._waiting += 1
        if self._waiting == self.refresh:
            if xp is np:
                with np.errstate(divide="ignore", invalid="ignore"):
                    self._refresh(xp, state)
            else:
                self._refresh(xp, state)

    def _refresh(self, xp: Any, state: dict[str, Any]) -> None:
        """Take the waiting steps into the window and derive the next steps' thresholds.
        They were all judged against the same statistics, so a spiking value among them
        enters clipped to the same ``mean + z·std``."""
        at_least: Any = np.maximum if xp is np else torch.clamp_min  # (clip is ~10x slower)
        sums, rows = state["sums"], state["rows"]
        if xp is np:
            waiting, self._host_waiting = np.array(self._host_waiting, dtype=np.float64), []
        else:
            waiting = state["waiting"][: self._waiting]
        x = xp.log10(waiting)
        present = xp.isfinite(x)
        taken = xp.where(x > state["limit"], state["clip"], x)
        fresh = xp.where(present[:, None], xp.stack([taken, taken * taken, present * 1.0], 1), 0.0)
        for slots, taken_rows in self._slots(len(fresh)):  # (slices: no index from the host)
            sums += fresh[taken_rows].sum(0) - rows[slots].sum(0)
            rows[slots] = fresh[taken_rows]
        self._position += self._waiting
        self._waiting = 0
        count = sums[2]
        mean = sums[0] / at_least(count, 1)
        spread = at_least(sums[1] / at_least(count, 1) - mean * mean, 0)
        std = at_least(xp.sqrt(spread), _MIN_STD_DECADES)
        armed = state["enabled"] & (count >= self.warmup)
        state["mean"] = mean
        state["inv_std"] = xp.where(count < 1, math.nan, 1.0 / std)
        state["typical"] = xp.where(count < 1, math.nan, 10.0**mean)
        state["clip"] = mean + state["z"] * std
        # spiking: z above its threshold and the norm above ratio × typical
        limit = mean + at_least(state["z"] * std, state["log_ratio"])
        state["limit"] = xp.where(armed, limit, math.inf)
        state["limit_norm"] = 10.0 ** state["limit"]
        self._limits = self._stats = None

    def _slots(self, n: int) -> list[tuple[slice, slice]]:
        """Where ``n`` steps enter the ring of the window's rows: (its slots, their rows)."""
        start = self._position % self.window
        end = start + n
        if end <= self.window:
            return [(slice(start, end), slice(0, n))]
        first = self.window - start
        return [
            (slice(start, self.window), slice(0, first)),
            (slice(0, end - self.window), slice(first, n)),
        ]
