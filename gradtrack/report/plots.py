"""The report's figures: each a function from `RunData` to a matplotlib Figure.

Plots only read `RunData`; they never touch a tracker. matplotlib is imported lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gradtrack.report.data import RunData, common_layer_steps

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _figure(width: float = 9.0, height: float = 4.0) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def total_norm(runs: list[RunData]) -> Figure:
    figure = _figure()
    axes = figure.add_subplot()
    for run in runs:
        values = np.where(run.total_norm > 0, run.total_norm, np.nan)
        axes.plot(run.steps, values, label=run.name, linewidth=1.2)
    axes.set(yscale="log", xlabel="step", ylabel="total gradient norm", title="Total gradient norm")
    axes.legend(loc="best", fontsize=8)
    axes.grid(alpha=0.3)
    return figure


def profile_steps(runs: list[RunData], count: int = 3) -> list[int]:
    """Steps every run logged, spread from first to last."""
    common = common_layer_steps(runs)
    if not common:
        return []
    picks = np.unique(np.linspace(0, len(common) - 1, count).round().astype(int))
    return [common[i] for i in picks]


def flow_profile(runs: list[RunData], steps: list[int]) -> Figure:
    """Per-layer norm by depth at chosen steps, runs overlaid: where gradients vanish or explode."""
    figure = _figure(10.0, 4.5)
    axes = figure.add_subplot()
    styles = ["-", "--", ":", "-."]
    for r, run in enumerate(runs):
        for s, step in enumerate(steps):
            row = run.norms[int(np.searchsorted(run.steps, step))]
            values = np.where(row > 0, row, np.nan)
            axes.plot(range(len(run.layers)), values, styles[r % len(styles)], marker=".",
                      label=f"{run.name} @ step {step}", color=f"C{s}")  # fmt: skip
    layers = runs[0].layers
    if len(layers) <= 40:
        axes.set_xticks(range(len(layers)), layers, rotation=60, ha="right", fontsize=7)
    axes.set(yscale="log", xlabel="layer (input → output)", ylabel="gradient norm",
             title="Gradient flow by depth")  # fmt: skip
    axes.legend(fontsize=7, ncol=2)
    axes.grid(alpha=0.3)
    return figure


def heatmap(run: RunData) -> Figure:
    figure = _figure(10.0, max(3.0, min(12.0, 0.18 * len(run.layers) + 1.5)))
    axes = figure.add_subplot()
    steps = run.per_layer_steps().tolist()
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log10(run.norms[run.layer_rows()].T)
    logs[~np.isfinite(logs)] = np.nan
    extent = (steps[0] - 0.5, steps[-1] + 0.5, len(run.layers) - 0.5, -0.5)
    image = axes.imshow(logs, aspect="auto", interpolation="nearest", cmap="viridis", extent=extent)
    if len(run.layers) <= 60:
        axes.set_yticks(range(len(run.layers)), run.layers, fontsize=6)
    axes.set(xlabel="step", ylabel="layer", title=f"{run.name}: log10 gradient norm")
    figure.colorbar(image, ax=axes, label="log10 norm")
    return figure


def histogram_evolution(runs: list[RunData], layer: str, snapshots: int = 5) -> Figure:
    figure = _figure(10.0, 3.5)
    for r, run in enumerate(runs):
        axes = figure.add_subplot(1, len(runs), r + 1)
        series = run.histograms.get(layer, [])
        picks: list[int] = []
        if series:
            spread = np.linspace(0, len(series) - 1, snapshots).round().astype(int)
            picks = np.unique(spread).tolist()
        for i, pick in enumerate(picks):
            step, histogram = series[pick]
            centers = (histogram.edges[:-1] + histogram.edges[1:]) / 2
            density = histogram.counts / max(1, histogram.counts.sum())
            axes.plot(centers, density, color=f"C{i}", label=f"step {step}", linewidth=1)
        xlabel = "log10 |g|" if series and series[0][1].scale == "log" else "gradient value"
        axes.set(title=f"{run.name}: {layer}", xlabel=xlabel, ylabel="fraction")
        if len(picks):
            axes.legend(fontsize=7)
        else:
            axes.text(0.5, 0.5, "no histograms", ha="center", transform=axes.transAxes)
    return figure


def alert_timeline(runs: list[RunData]) -> Figure:
    figure = _figure(10.0, 1.2 + 0.6 * len(runs))
    axes = figure.add_subplot()
    colors = {"info": "C0", "warning": "C1", "error": "C3"}
    for r, run in enumerate(runs):
        for alert in run.alerts:
            axes.scatter(alert.step, r, color=colors.get(alert.severity, "C7"), s=40, zorder=3)
            if alert.origin_layer:
                axes.annotate(alert.origin_layer, (alert.step, r), xytext=(3, 6),
                              textcoords="offset points", fontsize=7)  # fmt: skip
    axes.set_yticks(range(len(runs)), [run.name for run in runs])
    axes.set_ylim(-0.7, len(runs) - 0.3)
    axes.set(
        xlabel="step", title="Alerts (blue info, orange warning, red error; NaN/Inf origin named)"
    )
    axes.grid(alpha=0.3, axis="x")
    return figure
