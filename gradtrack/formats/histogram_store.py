"""Histograms stored as files: one compressed NPZ per chunk of steps, and its reader.

Layout of ``hist-<first step>-<last step>.npz`` (no pickled objects):
``steps`` int64 [n], ``layers`` str [n], ``scale`` str [n], ``zeros`` int64 [n],
``bins`` int64 [n] (bins of entry i), ``edges`` float64 [sum(bins) + n], ``counts`` int64
[sum(bins)] — entry i's edges and counts are consecutive slices of the flat arrays.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from gradtrack.formats.histogram import Histogram

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
