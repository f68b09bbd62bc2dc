"""The flight recorder's picture: log10 gradient norm per layer × step over a window, the
incident marked (red line) and the first mover's move (white line from where it began).

matplotlib is imported lazily; it draws a `FlightWindow` only, never a tracker.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gradtrack.formats.flight import FlightWindow
from gradtrack.report.plots import NONFINITE_COLOR, _figure, _layer_ticks

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def window_figure(window: FlightWindow, title: str = "") -> Figure:
    """Layers × steps, colour = log10 norm (NaN/Inf red), the incident a red line."""
    from matplotlib.colors import ListedColormap

    layers = list(window.layers)
    figure = _figure(10.0, max(3.0, min(12.0, 0.05 * len(layers) + 2.5)))
    axes = figure.add_subplot()
    values = window.norms.astype(np.float64).T  # [layers, steps]
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.where(np.isfinite(values) & (values > 0), np.log10(values), np.nan)
    steps = window.steps.astype(float)
    x = np.append(steps, steps[-1] + 1.0) - 0.5 if len(steps) else np.zeros(1)
    y = np.arange(len(layers) + 1) - 0.5
    image = None
    if len(steps) and np.isfinite(logs).any():
        image = axes.pcolormesh(x, y, np.ma.masked_invalid(logs), cmap="viridis")
    bad = np.where(np.isfinite(values) | (values == 0), np.nan, 1.0)
    if len(steps) and not np.isnan(bad).all():
        axes.pcolormesh(x, y, np.ma.masked_invalid(bad), cmap=ListedColormap([NONFINITE_COLOR]))
    axes.axvline(window.incident_step, color=NONFINITE_COLOR, linewidth=1.5)
    axes.annotate(
        f"{window.incident} at step {window.incident_step}", (window.incident_step, -0.5),
        xytext=(-4, -4), textcoords="offset points", ha="right", va="top", fontsize=7,
        bbox={"boxstyle": "round", "fc": "white", "alpha": 0.8},
    )  # fmt: skip
    if window.first_mover in layers and window.first_mover_step is not None:
        row = layers.index(window.first_mover)
        axes.plot([window.first_mover_step - 0.5, window.incident_step - 0.5], [row, row],
                  color="white", linewidth=2.0)  # fmt: skip
        axes.annotate(
            f"first mover: {window.first_mover}, from step {window.first_mover_step}",
            (window.first_mover_step, row), xytext=(-6, 8), textcoords="offset points",
            ha="right", fontsize=7, bbox={"boxstyle": "round", "fc": "white", "alpha": 0.8},
        )  # fmt: skip
    axes.set_ylim(len(layers) - 0.5, -0.5)
    _layer_ticks(axes, layers, axis="y", most=50)
    axes.set(xlabel="step", ylabel="layer (input → output)",
             title=title or f"gradient norms before the {window.incident} at step "
             f"{window.incident_step} (flight recorder)")  # fmt: skip
    if image is not None:
        figure.colorbar(image, ax=axes, label="log10 norm", fraction=0.04)
    return figure


def draw_window(window: FlightWindow, path: Path, title: str = "") -> Path:
    """The window's picture as a PNG at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    window_figure(window, title).savefig(path)
    return path
