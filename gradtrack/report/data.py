"""The one in-memory form every reader produces: runs × steps × layers × statistics.

Readers hand `from_series` the flat metric series they stored; everything else works on
`RunData` and never on a tracker.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from gradtrack.errors import GradtrackError
from gradtrack.formats.flight import FlightWindow
from gradtrack.formats.histogram import Histogram
from gradtrack.formats.metrics import LAYER_KEY_PREFIX, NONFINITE_KEY_PREFIX, TOTAL_NORM_KEY

LAYER_FAMILIES = tuple(LAYER_KEY_PREFIX.values())  # grad_norm, grad_max, grad_mean_abs, grad_rms
NONFINITE_FAMILIES = tuple(NONFINITE_KEY_PREFIX.values())  # grad_nan, grad_inf (non-zero only)
TOTAL_NONFINITE_KEYS = ("grad/nan_count", "grad/inf_count")
# MLflow stores ±Inf as ±1.8e308 (its largest double); anything this large was an Inf.
_STORED_INF = 1.7e308
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
    origin_stage: str | None = None  # where a non-finite gradient was made (the event's)


class FirstNonFinite(NamedTuple):
    """A run's first step whose gradient held a NaN or Inf, and where it came from: the
    layer it names (the event's origin, else the first non-finite layer in depth order;
    None where the loss made it or only the totals say so) and the event's stage."""

    step: int
    layer: str | None
    stage: str | None = None


@dataclass
class RunData:
    """One run's gradient flow: ``stats[family]`` is a [steps, layers] array.

    A value can itself be NaN (a NaN gradient), so what was not logged is told apart by
    ``logged[family]`` (a boolean [steps, layers] array); without it, NaN means not logged.
    """

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
    logged: dict[str, np.ndarray] = field(default_factory=dict)
    # NaN + Inf elements per [step, layer] (from grad_nan/*, grad_inf/*; 0 where none logged).
    nonfinite_counts: np.ndarray | None = None
    # NaN + Inf elements over all layers per step (grad/nan_count + grad/inf_count; NaN: absent).
    total_nonfinite: np.ndarray | None = None
    total_logged: np.ndarray | None = None  # per step: grad/total_norm was logged
    run_id: str = ""
    # The flight recorder's windows the run holds (`gradtrack.formats.flight`), by step.
    windows: list[FlightWindow] = field(default_factory=list)

    @property
    def norms(self) -> np.ndarray:
        return self.stats["grad_norm"]

    def logged_mask(self, family: str = "grad_norm") -> np.ndarray:
        """Where ``stats[family]`` holds a logged value (a NaN gradient included)."""
        if family in self.logged:
            return self.logged[family]
        return ~np.isnan(self.stats[family])

    def total_logged_mask(self) -> np.ndarray:
        if self.total_logged is not None:
            return self.total_logged
        return ~np.isnan(self.total_norm)

    def first_nonfinite(self) -> FirstNonFinite | None:
        """The first step whose gradient held a NaN or Inf, and where it came from, as the
        `nonfinite` event at that step tells it (see `FirstNonFinite`)."""
        bad = ~np.isfinite(self.total_norm) & self.total_logged_mask()
        if self.total_nonfinite is not None:
            bad |= np.nan_to_num(self.total_nonfinite) > 0
        bad_layers = np.zeros_like(self.norms, dtype=bool)
        for family, table in self.stats.items():
            bad_layers |= ~np.isfinite(table) & self.logged_mask(family)
        if self.nonfinite_counts is not None:
            bad_layers |= self.nonfinite_counts > 0
        bad |= bad_layers.any(axis=1)
        if not bad.any():
            return None
        row = int(np.argmax(bad))
        step = int(self.steps[row])
        events = [a for a in self.alerts if a.step == step and a.rule == "nonfinite"]
        stage = events[0].origin_stage if events else None
        if events and events[0].origin_layer:
            return FirstNonFinite(step, events[0].origin_layer, stage)
        if stage in ("loss", "weights", "forward"):
            return FirstNonFinite(step, None, stage)  # no layer made it: none is blamed
        columns = np.flatnonzero(bad_layers[row])
        return FirstNonFinite(step, self.layers[int(columns[0])] if len(columns) else None, stage)

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
    run_id: str = "",
) -> RunData:
    """Build `RunData` from ``{metric key: [(step, value), ...]}`` as gradtrack logged it."""
    per_family: dict[str, dict[str, Sequence[tuple[int, float]]]] = {
        f: {} for f in (*LAYER_FAMILIES, *NONFINITE_FAMILIES)
    }
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
    stats, logged = {}, {}
    for family in LAYER_FAMILIES:
        stats[family], logged[family] = _table(per_family[family], layers, index)
    counts = np.zeros((len(steps), len(layers)))
    for family in NONFINITE_FAMILIES:
        table, present = _table(per_family[family], layers, index)
        counts += np.where(present, table, 0.0)
    total, total_logged = _column(series.get(TOTAL_NORM_KEY, ()), index)
    total_nonfinite = np.zeros(len(steps))
    for key in TOTAL_NONFINITE_KEYS:
        column, present = _column(series.get(key, ()), index)
        total_nonfinite += np.where(present, column, 0.0)
    return RunData(
        name=name,
        source=source,
        steps=np.array(steps, dtype=np.int64),
        layers=layers,
        stats=stats,
        total_norm=total,
        histograms=histograms or {},
        alerts=alerts or [],
        layer_steps=np.array(sorted(layer_logged), dtype=np.int64),
        logged=logged,
        nonfinite_counts=counts,
        total_nonfinite=total_nonfinite,
        total_logged=total_logged,
        run_id=run_id,
    )


def _table(
    by_layer: Mapping[str, Sequence[tuple[int, float]]], layers: list[str], index: dict[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """[steps, layers] values and where they were logged."""
    table = np.full((len(index), len(layers)), np.nan)
    present = np.zeros(table.shape, dtype=bool)
    for j, layer in enumerate(layers):
        for step, value in by_layer.get(layer, ()):
            if step in index:
                table[index[step], j] = _unstored(value)
                present[index[step], j] = True
    return table, present


def _column(
    values: Sequence[tuple[int, float]], index: dict[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    column = np.full(len(index), np.nan)
    present = np.zeros(len(index), dtype=bool)
    for step, value in values:
        if step in index:
            column[index[step]], present[index[step]] = _unstored(value), True
    return column, present


def _unstored(value: float) -> float:
    return float(np.copysign(np.inf, value)) if abs(value) >= _STORED_INF else float(value)


def parse_alert_text(text: str, rule: str, severity: str) -> Alert:
    """An alert whose text starts ``step N: …`` (as the W&B and MLflow sinks write it)."""
    match = re.match(r"step (\d+): (.*)", text, re.S)
    step = int(match.group(1)) if match else -1
    message = match.group(2) if match else text
    origin = re.search(r"gradient first at (\S+) \(", message)
    layer = origin.group(1) if origin else None
    return Alert(step, rule, severity, message, origin_layer=layer, origin_stage=_stage_in(message))


def _stage_in(message: str) -> str | None:
    """The stage a `nonfinite` message names (`gradtrack.alerts.nonfinite`'s wording).

    >>> _stage_in("NaN gradient made by the loss: the gradient reaching ..."), _stage_in("x")
    ('loss', None)
    """
    for stage, words in _STAGE_WORDS:
        if words in message:
            return stage
    return None


_STAGE_WORDS = (
    ("loss", "gradient made by the loss:"),
    ("forward", "gradient made in the forward pass"),
    ("forward", "gradient from the input batch"),
    ("weights", "gradient because the weights are non-finite"),
    ("backward", "gradient first at "),
)
