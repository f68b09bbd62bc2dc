"""Histograms of sampled gradient elements, binned on the CPU by the worker thread.

Non-finite samples never reach the bins: they are counted in the summaries instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Histogram:
    """Bin edges (``bins + 1``, increasing) and counts of one layer's sampled gradient.

    With ``scale="log"`` the bins are over log10 |g|, and exact zeros, which have no
    logarithm, are counted in ``zeros``. ``sample_size`` counts the finite sampled elements.
    """

    edges: np.ndarray
    counts: np.ndarray
    scale: str = "linear"
    zeros: int = 0

    @property
    def sample_size(self) -> int:
        return int(self.counts.sum()) + self.zeros


def bin_samples(samples: np.ndarray, bins: int, scale: str = "linear") -> Histogram | None:
    """Bin the finite values of ``samples`` into ``bins`` equal-width bins; None if none are finite.

    >>> h = bin_samples(np.array([0.0, 1.0, 1.0, np.nan]), bins=2)
    >>> h.counts.tolist(), h.edges.tolist()
    ([1, 2], [0.0, 0.5, 1.0])
    >>> h = bin_samples(np.array([0.0, -1e-6, 1e-3, 10.0]), bins=3, scale="log")
    >>> h.counts.tolist(), h.edges.tolist(), h.zeros
    ([1, 1, 1], [-6.0, -3.666..., -1.333..., 1.0], 1)
    """
    finite = samples[np.isfinite(samples)].astype(np.float64, copy=False)
    if finite.size == 0:
        return None
    if scale == "log":
        magnitude = np.abs(finite)
        nonzero = magnitude[magnitude > 0]
        zeros = int(finite.size - nonzero.size)
        if nonzero.size == 0:
            return Histogram(np.array([0.0, 1.0]), np.zeros(1, dtype=np.int64), scale, zeros)
        values = np.log10(nonzero)
        counts, edges = np.histogram(values, bins=bin_edges(values, bins))
        return Histogram(edges, counts.astype(np.int64), scale, zeros)
    counts, edges = np.histogram(finite, bins=bin_edges(finite, bins))
    return Histogram(edges=edges, counts=counts.astype(np.int64))


def bin_edges(values: np.ndarray, bins: int) -> np.ndarray:
    """``bins + 1`` increasing edges spanning the finite ``values``, for any range numpy
    cannot split itself: one value (a constant gradient), a span below the values'
    resolution, |g| near the float maximum, subnormals.

    >>> bin_edges(np.array([2.0, 2.0]), 2).tolist()
    [1.999, 2.0, 2.001]
    >>> edges = bin_edges(np.array([1e300, -1e300, 1.7e308]), 4)
    >>> bool(np.all(np.isfinite(edges)) and np.all(np.diff(edges) > 0))
    True
    """
    low, high = float(values.min()), float(values.max())
    # The narrowest span whose bins stay distinct at this magnitude (fp64 spacing), or 0.1 %.
    least = max(abs(low), abs(high)) * max(1e-3, 4 * bins * np.finfo(np.float64).eps)
    least = max(least, bins * float(np.finfo(np.float64).smallest_normal))
    if high - low < least:
        middle = low / 2 + high / 2
        low, high = middle - least / 2, middle + least / 2
    # Halves first: high - low can overflow when both ends are near the float maximum.
    return low + (np.linspace(0.0, 1.0, bins + 1) * (high / 2 - low / 2)) * 2


def split_in_proportion(count: int, sizes: np.ndarray) -> np.ndarray:
    """``min(count, sizes.sum())`` sample elements split over tensors (or shards) of
    ``sizes`` elements in proportion to their size, the largest remainders taking the
    leftover: each element is then equally likely to be drawn, whichever part holds it.

    >>> split_in_proportion(5, np.array([6, 3, 0, 1]))
    array([3, 2, 0, 0])
    >>> split_in_proportion(50, np.array([6, 3]))
    array([6, 3])
    """
    total = int(sizes.sum())
    if total <= count:
        return sizes.astype(np.int64)
    exact = count * sizes / total
    share = np.floor(exact).astype(np.int64)
    leftover = count - int(share.sum())
    share[np.argsort(share - exact, kind="stable")[:leftover]] += 1
    return share
