"""The per-step rules' one vectorised check each, shared by both threads: the training thread's
``skip`` and ``raise`` (on a step's norms, before its optimizer step) and the worker's alerts
(on its record) trip on exactly the same columns.

Columns are a step's norms: the total or each layer's, in whichever order the caller holds
them; thresholds and ``enabled`` are per column.
"""

from __future__ import annotations

import numpy as np


def nonfinite_columns(
    norms: np.ndarray, nan: np.ndarray | None = None, inf: np.ndarray | None = None
) -> np.ndarray:
    """Columns whose gradient holds NaN or Inf: a non-finite norm (exact norms are non-finite
    only where an element is), or counted NaN/Inf elements where they were counted.

    >>> nonfinite_columns(np.array([1.0, np.nan, np.inf])).tolist()
    [False, True, True]
    """
    bad = ~np.isfinite(norms)
    if nan is not None and inf is not None:
        bad |= (nan > 0) | (inf > 0)
    return bad


def exploding_columns(norms: np.ndarray, threshold: np.ndarray, enabled: np.ndarray) -> np.ndarray:
    """Columns whose finite norm is above their threshold (a non-finite norm is the nonfinite
    rule's finding, not this one's).

    >>> exploding_columns(np.array([5.0, 50.0, np.inf]), np.full(3, 10.0), np.ones(3, bool))
    array([False,  True, False])
    """
    with np.errstate(invalid="ignore"):
        return enabled & np.isfinite(norms) & (norms > threshold)


def spiking_columns(spiking: np.ndarray, enabled: np.ndarray) -> np.ndarray:
    """Columns the every-step spike window flagged (`gradtrack.handoff.layout.spike_fields`),
    where the rule is on."""
    return spiking & enabled
