"""Histograms of sampled gradient elements, binned on the CPU by the worker thread.

Non-finite samples never reach the bins: they are counted in the summaries instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Histogram:
    """Bin edges (``bins + 1``, increasing) and counts of one layer's sampled gradient.

    ``counts.sum() == sample_size``: the finite elements of the sample.
    """

    edges: np.ndarray
    counts: np.ndarray

    @property
    def sample_size(self) -> int:
        return int(self.counts.sum())


def bin_samples(samples: np.ndarray, bins: int) -> Histogram | None:
    """Bin the finite values of ``samples`` into ``bins`` equal-width bins; None if none are finite.

    >>> h = bin_samples(np.array([0.0, 1.0, 1.0, np.nan]), bins=2)
    >>> h.counts.tolist(), h.edges.tolist()
    ([1, 2], [0.0, 0.5, 1.0])
    """
    finite = samples[np.isfinite(samples)].astype(np.float64, copy=False)
    if finite.size == 0:
        return None
    counts, edges = np.histogram(finite, bins=bins)
    return Histogram(edges=edges, counts=counts.astype(np.int64))
