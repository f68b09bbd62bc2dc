"""Histograms of sampled gradient elements: binned on the CPU by the worker thread, and
stored as files (one compressed NPZ per chunk of steps) with their reader.

Non-finite samples never reach the bins: they are counted in the summaries instead.

Layout of ``hist-<first step>-<last step>.npz`` (no pickled objects):
``steps`` int64 [n], ``layers`` str [n], ``scale`` str [n], ``zeros`` int64 [n],
``bins`` int64 [n] (bins of entry i), ``edges`` float64 [sum(bins) + n], ``counts`` int64
[sum(bins)] — entry i's edges and counts are consecutive slices of the flat arrays.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

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
    edges = low + (np.linspace(0.0, 1.0, bins + 1) * (high / 2 - low / 2)) * 2
    # The ends exactly: rounded, the last edge can fall below the largest value, which numpy
    # then leaves out of every bin (one histogram in sixteen lost its maximum).
    edges[0], edges[-1] = low, high
    return edges


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


HistogramEntry = tuple[int, str, Histogram]


def write_chunk(directory: Path, entries: list[HistogramEntry]) -> Path:
    """Write ``entries`` (step, layer, histogram) to one NPZ file in ``directory``."""
    steps = np.array([step for step, _, _ in entries], dtype=np.int64)
    path = directory / f"hist-{steps.min():09d}-{steps.max():09d}.npz"
    histograms = [h for _, _, h in entries]
    np.savez_compressed(
        path,
        steps=steps,
        layers=np.array([layer for _, layer, _ in entries], dtype=str),
        scale=np.array([h.scale for h in histograms], dtype=str),
        zeros=np.array([h.zeros for h in histograms], dtype=np.int64),
        bins=np.array([len(h.counts) for h in histograms], dtype=np.int64),
        edges=np.concatenate([h.edges for h in histograms]).astype(np.float64),
        counts=np.concatenate([h.counts for h in histograms]).astype(np.int64),
    )
    return path


def read_chunks(paths: Iterable[Path]) -> dict[str, list[tuple[int, Histogram]]]:
    """``{layer: [(step, Histogram), ...]}`` in step order, from chunk files."""
    series: dict[str, list[tuple[int, Histogram]]] = {}
    for path in sorted(paths):
        with np.load(path, allow_pickle=False) as chunk:
            bins = chunk["bins"]
            count_end = np.cumsum(bins)
            edge_end = count_end + np.arange(1, len(bins) + 1)
            for i, (step, layer) in enumerate(zip(chunk["steps"].tolist(), chunk["layers"])):
                histogram = Histogram(
                    edges=chunk["edges"][edge_end[i] - bins[i] - 1 : edge_end[i]],
                    counts=chunk["counts"][count_end[i] - bins[i] : count_end[i]],
                    scale=str(chunk["scale"][i]),
                    zeros=int(chunk["zeros"][i]),
                )
                series.setdefault(str(layer), []).append((int(step), histogram))
    for values in series.values():
        values.sort(key=lambda item: item[0])
    return series
