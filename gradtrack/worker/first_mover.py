"""The first mover of an incident: the layer whose gradient norm left its own running range
first in the steps before it, and the step its move began. Pure numpy, on the worker.

Each layer's range is its median and spread (MAD) of log10 norms over the window's steps
before the incident: robust to the move itself, which takes a minority of the window. A
layer has moved where it stays out of that range (``z`` spreads and at least ``margin``
decades) from some step to the incident; its move began where it last sat inside one
spread of its median before that. The earliest beginning names the first mover.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

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
