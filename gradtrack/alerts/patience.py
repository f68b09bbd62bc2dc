"""`Runs`: per layer, how many logged steps in a row a rule's condition held (its patience)."""

from __future__ import annotations

import numpy as np


class Runs:
    """Consecutive-hit counters, one per layer in depth order."""

    def __init__(self, layers: int) -> None:
        self.counts = np.zeros(layers, dtype=np.int64)

    def advance(self, idx: np.ndarray, active: np.ndarray, hit: np.ndarray) -> np.ndarray:
        """The counters of the layers at ``idx`` after this step: +1 on a ``hit``, back to 0
        otherwise; only the ``active`` ones (their rule is on, their value usable) are kept.

        >>> runs = Runs(3)
        >>> idx = np.arange(3)
        >>> runs.advance(idx, np.array([True, True, False]), np.array([True, False, True]))
        array([1, 0, 1])
        >>> runs.counts
        array([1, 0, 0])
        """
        updated = np.where(hit, self.counts[idx] + 1, 0)
        self.counts[idx[active]] = updated[active]
        return updated
