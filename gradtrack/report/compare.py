"""Which layers' gradient flow differs most between runs (pure numpy on `RunData`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gradtrack.report.data import RunData, common_layer_steps


@dataclass(frozen=True)
class LayerDifference:
    layer: str
    mean_log10_norm: tuple[float, ...]  # per run, over the steps all runs logged
    spread: float  # mean over those steps of (max - min) log10 norm across runs


def rank_layers(runs: list[RunData]) -> list[LayerDifference]:
    """Layers present in every run, most different first.

    With one run, the spread is the distance below the run's strongest layer: the weakest
    gradient flow comes first.

    >>> steps, layers = np.array([0, 1]), ["x", "y"]
    >>> a = RunData("a", "", steps, layers, {"grad_norm": np.array([[1.0, 1], [1, 1]])}, steps)
    >>> b = RunData("b", "", steps, layers, {"grad_norm": np.array([[1e-6, 1], [1e-6, 1]])}, steps)
    >>> [(d.layer, round(d.spread, 3)) for d in rank_layers([a, b])]
    [('x', 6.0), ('y', 0.0)]
    """
    layers = [layer for layer in runs[0].layers if all(layer in run.layers for run in runs)]
    steps = common_layer_steps(runs)
    logs = np.stack([_log_norms(run, layers, steps) for run in runs])  # [runs, steps, layers]
    with np.errstate(all="ignore"):
        means = np.nanmean(logs, axis=1)  # [runs, layers]
        if len(runs) > 1:
            spread = np.nanmean(np.nanmax(logs, axis=0) - np.nanmin(logs, axis=0), axis=0)
        else:
            spread = np.nanmax(means[0]) - means[0]
    ranked = [
        LayerDifference(layer, tuple(float(m) for m in means[:, j]), float(spread[j]))
        for j, layer in enumerate(layers)
    ]
    return sorted(ranked, key=lambda d: -np.nan_to_num(d.spread, nan=-np.inf))


def _log_norms(run: RunData, layers: list[str], steps: list[int]) -> np.ndarray:
    rows = np.searchsorted(run.steps, steps)
    cols = np.array([run.layers.index(layer) for layer in layers], dtype=np.int64)
    norms = run.norms[np.ix_(rows, cols)]
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log10(norms)
    logs[~np.isfinite(logs)] = np.nan
    return logs
