"""Which layers' gradient flow differs most between runs, and how early (numpy on `RunData`).

NaN, Inf and exact zero count as the strongest differences; they are never averaged away.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gradtrack.report.data import RunData, common_layer_steps
from gradtrack.report.divergence import DEFAULT_RTOL, KINDS, kind_of, parts


@dataclass(frozen=True)
class LayerDifference:
    layer: str
    mean_log10_norm: tuple[float, ...]  # per run, over the finite non-zero norms of the steps
    spread: float  # mean over those steps of (max - min) finite log10 norm across runs
    first_step: int | None = None  # the first step at which the runs part in this layer
    kind: str | None = None  # the strongest difference seen: one of KINDS, None if never

    @property
    def rank_key(self) -> tuple[int, float, float]:
        """Strongest kind first, then earliest, then largest spread."""
        severity = 3 - KINDS.index(self.kind) if self.kind else 0
        first = math.inf if self.first_step is None else self.first_step
        spread = -np.inf if math.isnan(self.spread) else self.spread
        return (-severity, first, -spread)


def rank_layers(runs: list[RunData], rtol: float = DEFAULT_RTOL) -> list[LayerDifference]:
    """Layers present in every run, most different first: a layer that is non-finite (or
    exactly zero) in one run and not in another comes before any finite difference, then
    the earlier parting, then the larger spread in decades.

    With one run, the layers compared are the run's own: non-finite or zero layers first,
    then the distance below the run's strongest layer (the weakest gradient flow first).

    >>> steps, layers = np.array([0, 1]), ["x", "y", "z"]
    >>> ones, broken = np.ones((2, 3)), np.array([[1e-6, 1, 1], [1e-6, 1, np.nan]])
    >>> a = RunData("a", "", steps, layers, {"grad_norm": ones}, steps)
    >>> b = RunData("b", "", steps, layers, {"grad_norm": broken}, steps,
    ...             logged={"grad_norm": ones > 0})  # logged everywhere: z's NaN is a NaN gradient
    >>> [(d.layer, d.kind, d.first_step, round(d.spread, 3)) for d in rank_layers([a, b])]
    [('z', 'nonfinite', 1, 0.0), ('x', 'value', 0, 6.0), ('y', None, None, 0.0)]
    """
    layers = [layer for layer in runs[0].layers if all(layer in run.layers for run in runs)]
    steps = np.array(common_layer_steps(runs), dtype=np.int64)
    norms = np.stack([_norms(run, layers, steps) for run in runs])  # [runs, steps, layers]
    with np.errstate(all="ignore"):
        logs = np.log10(np.abs(norms))
    logs[~np.isfinite(logs)] = np.nan
    means = _nanmean(logs, axis=1)  # [runs, layers]
    if len(runs) > 1:
        spread = _nanmean(np.fmax.reduce(logs, axis=0) - np.fmin.reduce(logs, axis=0), axis=0)
    else:
        spread = np.fmax.reduce(means[0]) - means[0] if means.size else means[0]
    if len(runs) > 1:
        reference = norms[0]
        differ = np.stack([parts(reference, other, rtol) for other in norms[1:]])
        kinds = np.stack([kind_of(reference, other) for other in norms[1:]])
        severity = np.where(differ, kinds, 0).max(axis=0)  # [steps, layers]
    else:
        own = norms[0]
        severity = np.where(~np.isfinite(own), 3, np.where(own == 0, 2, 0))
    severity = np.where(_all_logged(runs, layers, steps), severity, 0)  # no evidence: no gap
    ranked = []
    for j, layer in enumerate(layers):
        column = severity[:, j]
        hit = np.flatnonzero(column)
        ranked.append(
            LayerDifference(
                layer,
                tuple(float(m) for m in means[:, j]),
                float(spread[j]),
                int(steps[hit[0]]) if len(hit) else None,
                KINDS[3 - int(column.max())] if len(hit) else None,
            )
        )
    return sorted(ranked, key=lambda d: d.rank_key)


def _nanmean(values: np.ndarray, axis: int) -> np.ndarray:
    """Mean of the non-NaN values; NaN where there are none. Unlike ``np.nanmean`` it warns
    of nothing, and so needs no warnings filter (not thread-safe: sinks draw on their own
    threads)."""
    present = ~np.isnan(values)
    count = present.sum(axis=axis)
    total = np.where(present, values, 0.0).sum(axis=axis)
    with np.errstate(all="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def _norms(run: RunData, layers: list[str], steps: np.ndarray) -> np.ndarray:
    """[steps, layers] norms; NaN where the norm was NaN or not logged (see `_all_logged`)."""
    rows = np.searchsorted(run.steps, steps)
    cols = np.array([run.layers.index(layer) for layer in layers], dtype=np.int64)
    return run.norms[np.ix_(rows, cols)] if len(cols) else np.empty((len(steps), 0))


def _all_logged(runs: list[RunData], layers: list[str], steps: np.ndarray) -> np.ndarray:
    """[steps, layers]: every run logged the norm there (a NaN norm then is a NaN gradient)."""
    mask = np.ones((len(steps), len(layers)), dtype=bool)
    for run in runs:
        rows = np.searchsorted(run.steps, steps)
        cols = np.array([run.layers.index(layer) for layer in layers], dtype=np.int64)
        if len(cols):
            mask &= run.logged_mask("grad_norm")[np.ix_(rows, cols)]
    return mask
