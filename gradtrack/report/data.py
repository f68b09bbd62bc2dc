"""The one in-memory form every reader produces: runs × steps × layers × statistics.

Readers hand `from_series` the flat metric series they stored; everything else works on
`RunData` and never on a tracker.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradtrack.errors import GradtrackError
from gradtrack.histogram import Histogram
from gradtrack.record import LAYER_KEY_PREFIX, TOTAL_NORM_KEY

LAYER_FAMILIES = tuple(LAYER_KEY_PREFIX.values())  # grad_norm, grad_max, grad_mean_abs, grad_rms
Series = Mapping[str, Sequence[tuple[int, float]]]
Progress = Callable[[str, int, int], None]


@dataclass
class Alert:
    step: int
    rule: str
    severity: str
    message: str
    layer: str | None = None
    origin_layer: str | None = None


@dataclass
class RunData:
    """One run's gradient flow: ``stats[family]`` is a [steps, layers] array (NaN: not logged)."""

    name: str
    source: str
    steps: np.ndarray
    layers: list[str]
    stats: dict[str, np.ndarray]
    total_norm: np.ndarray
    histograms: dict[str, list[tuple[int, Histogram]]] = field(default_factory=dict)
    alerts: list[Alert] = field(default_factory=list)
    # The steps that carry per-layer statistics (``layer_every``); default: all of ``steps``.
    layer_steps: np.ndarray | None = None

    @property
    def norms(self) -> np.ndarray:
        return self.stats["grad_norm"]

    def per_layer_steps(self) -> np.ndarray:
        """The steps that carry per-layer statistics."""
        return self.steps if self.layer_steps is None else self.layer_steps

    def layer_rows(self) -> np.ndarray:
        """Row indices of `per_layer_steps` in the [steps, layers] tables."""
        return np.searchsorted(self.steps, self.per_layer_steps())


def common_layer_steps(runs: Sequence[RunData]) -> list[int]:
    """Steps at which every run logged its per-layer statistics."""
    return sorted(set.intersection(*(set(run.per_layer_steps().tolist()) for run in runs)))


def natural_key(name: str) -> list[Any]:
    """Sort key that puts ``layers.10`` after ``layers.9``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def from_series(
    name: str,
    source: str,
    series: Series,
    layer_order: Sequence[str] = (),
    histograms: dict[str, list[tuple[int, Histogram]]] | None = None,
    alerts: list[Alert] | None = None,
) -> RunData:
    """Build `RunData` from ``{metric key: [(step, value), ...]}`` as gradtrack logged it."""
    per_family: dict[str, dict[str, Sequence[tuple[int, float]]]] = {f: {} for f in LAYER_FAMILIES}
    for key, values in series.items():
        family, _, layer = key.partition("/")
        if family in per_family and layer:
            per_family[family][layer] = values
    if not per_family["grad_norm"] and TOTAL_NORM_KEY not in series:
        found = sorted(series)[:12]
        raise GradtrackError(
            f"{source} holds no gradtrack data (no {TOTAL_NORM_KEY} or grad_norm/* metrics); "
            f"metrics found instead: {found or 'none'}"
        )
    known = set(per_family["grad_norm"])
    layers = [layer for layer in layer_order if layer in known]
    layers += sorted(known - set(layers), key=natural_key)
    layer_logged = {s for values in per_family["grad_norm"].values() for s, _ in values}
    steps = sorted(layer_logged | {s for s, _ in series.get(TOTAL_NORM_KEY, ())})
    index = {step: i for i, step in enumerate(steps)}
    stats = {}
    for family, by_layer in per_family.items():
        table = np.full((len(steps), len(layers)), np.nan)
        for j, layer in enumerate(layers):
            for step, value in by_layer.get(layer, ()):
                table[index[step], j] = value
        stats[family] = table
    total = np.full(len(steps), np.nan)
    for step, value in series.get(TOTAL_NORM_KEY, ()):
        total[index[step]] = value
    return RunData(
        name=name, source=source, steps=np.array(steps, dtype=np.int64), layers=layers,
        stats=stats, total_norm=total, histograms=histograms or {}, alerts=alerts or [],
        layer_steps=np.array(sorted(layer_logged), dtype=np.int64),
    )  # fmt: skip


def parse_alert_text(text: str, rule: str, severity: str) -> Alert:
    """An alert whose text starts ``step N: …`` (as the W&B and MLflow sinks write it)."""
    match = re.match(r"step (\d+): (.*)", text, re.S)
    step = int(match.group(1)) if match else -1
    message = match.group(2) if match else text
    origin = re.search(r"gradient first at (\S+) \(", message)
    return Alert(step, rule, severity, message, origin_layer=origin.group(1) if origin else None)
