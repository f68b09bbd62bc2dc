"""What a sink draws of its own run: the run's pictures (at close, or every N steps), and a
flight recorder window's file and picture (`stage_window`).

For the run's pictures a sink keeps a bounded copy of what it wrote: past a bound every other
entry goes (the first non-finite step always stays), so a run of any length costs the same
memory.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

from gradtrack.formats import write_atomic
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.flight import FlightWindow, window_name, window_text
from gradtrack.formats.histogram import Histogram
from gradtrack.formats.record import StepRecord
from gradtrack.log import report
from gradtrack.report.data import Alert, RunData

T = TypeVar("T")


def can_draw() -> bool:
    """matplotlib is installed (``pip install gradtrack[report]``)."""
    return importlib.util.find_spec("matplotlib") is not None


class FlowHistory:
    """Totals of every logged step, per-layer norms of the per-layer steps, histograms and
    alerts of one run, each thinned by halves past its bound."""

    def __init__(
        self, max_steps: int = 4000, max_layer_steps: int = 400, max_hist_steps: int = 60
    ) -> None:
        self.max_steps, self.max_layer_steps = max_steps, max_layer_steps
        self.max_hist_steps = max_hist_steps
        self._layers: dict[str, int] = {}
        self._totals: list[tuple[int, float, float]] = []  # step, total norm, NaN+Inf count
        self._columns: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []
        self._histograms: list[tuple[int, dict[str, Histogram]]] = []
        self._alerts: list[Alert] = []

    def __len__(self) -> int:
        return len(self._totals)

    def add(self, record: StepRecord) -> None:
        nonfinite = float(record.nan_count + record.inf_count)
        self._totals.append((record.step, record.total_norm, nonfinite))
        if record.per_layer:
            for layer in record.layers:
                self._layers.setdefault(layer, len(self._layers))
            index = np.array([self._layers[layer] for layer in record.layers], dtype=np.int64)
            counts = record.column("nan") + record.column("inf")
            self._columns.append((record.step, index, record.column("norm").copy(), counts))
        if record.histograms:
            self._histograms.append((record.step, dict(record.histograms)))
        self._totals = _thin(self._totals, self.max_steps, lambda t: t[2] > 0)
        self._columns = _thin(self._columns, self.max_layer_steps, lambda c: bool(c[3].any()))
        self._histograms = _thin(self._histograms, self.max_hist_steps, lambda h: False)

    def alert(self, event: AlertEvent) -> None:
        if len(self._alerts) < 1000:
            self._alerts.append(
                Alert(
                    event.step,
                    event.rule,
                    event.severity,
                    event.message,
                    event.layer,
                    event.origin_layer,
                    event.origin_stage,
                )
            )

    def run_data(self, name: str, source: str, run_id: str = "") -> RunData:
        layers = list(self._layers)
        steps = sorted({s for s, _, _ in self._totals} | {c[0] for c in self._columns})
        row = {step: i for i, step in enumerate(steps)}
        norms = np.full((len(steps), len(layers)), np.nan)
        logged = np.zeros(norms.shape, dtype=bool)
        counts = np.zeros(norms.shape)
        for step, index, values, layer_nonfinite in self._columns:
            norms[row[step], index] = values
            logged[row[step], index] = True
            counts[row[step], index] = layer_nonfinite
        total = np.full(len(steps), np.nan)
        total_logged = np.zeros(len(steps), dtype=bool)
        total_nonfinite = np.zeros(len(steps))
        for step, value, nonfinite in self._totals:
            total[row[step]] = value
            total_logged[row[step]] = True
            total_nonfinite[row[step]] = nonfinite
        histograms: dict[str, list[tuple[int, Histogram]]] = {}
        for step, by_layer in self._histograms:
            for layer, histogram in by_layer.items():
                histograms.setdefault(layer, []).append((step, histogram))
        return RunData(
            name=name,
            source=source,
            steps=np.array(steps, dtype=np.int64),
            layers=layers,
            stats={"grad_norm": norms},
            total_norm=total,
            histograms=histograms,
            alerts=list(self._alerts),
            layer_steps=np.array(sorted(c[0] for c in self._columns), dtype=np.int64),
            logged={"grad_norm": logged},
            nonfinite_counts=counts,
            total_nonfinite=total_nonfinite,
            total_logged=total_logged,
            run_id=run_id,
        )


def _thin(entries: list[T], bound: int, keep: Callable[[T], bool]) -> list[T]:
    """Every other entry once there are twice ``bound``; the first one ``keep`` marks stays."""
    if len(entries) <= 2 * bound:
        return entries
    first = next((i for i, e in enumerate(entries) if keep(e)), None)
    return [e for i, e in enumerate(entries) if i % 2 == 0 or i == first]


def draw_pictures(history: FlowHistory, out_dir: Path, name: str, source: str) -> list[Path]:
    """The one-run report of ``history`` in ``out_dir``: its PNGs and ``report.html``."""
    from gradtrack.report.render import render_report

    html = render_report([history.run_data(name, source)], out_dir)
    return [*sorted(out_dir.glob("*.png")), html]


class Pictures:
    """When a sink draws its run's pictures, and the history it keeps to draw them."""

    def __init__(self, enabled: bool, every: int | None) -> None:
        self.enabled = enabled and can_draw()
        self.every = every
        self.history = FlowHistory()
        self._window = 0

    def add(self, batch: Sequence[StepRecord]) -> bool:
        """Keep the batch; True when ``every`` steps have passed since the last drawing."""
        if not self.enabled:
            return False
        for record in batch:
            self.history.add(record)
        if self.every is None or not batch:
            return False
        window = batch[-1].step // self.every
        due, self._window = window > self._window, max(window, self._window)
        return due

    def alert(self, event: AlertEvent) -> None:
        if self.enabled:
            self.history.alert(event)

    def due_at_close(self) -> bool:
        return self.enabled and len(self.history) > 0

    def draw(self, directory: Path, name: str, source: str) -> list[Path]:
        """The pictures' files; none (and one warning) if drawing failed: pictures must
        never cost the run its data."""
        try:
            return draw_pictures(self.history, directory, name, source)
        except Exception as exc:
            try:  # on the worker thread: a warning turned into an error must not stop it
                warnings.warn(
                    f"gradtrack could not draw the run's gradient-flow pictures: {exc!r}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            except Exception:
                pass
            return []


def stage_window(window: FlightWindow, folder: Path, title: str = "") -> list[Path]:
    """The window's JSON file (`gradtrack.formats.flight`) and, where matplotlib is
    installed, its PNG, in ``folder``: what a tracker sink uploads for the window."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / window_name(window)
    write_atomic(path, window_text(window), fsync=False)
    paths = [path]
    if can_draw():
        from gradtrack.report.plots import draw_window

        try:
            paths.append(draw_window(window, path.with_suffix(".png"), title))
        except Exception as exc:  # a picture must not cost the window
            report(f"gradtrack could not draw the flight window's picture: {exc!r}")
    return paths
