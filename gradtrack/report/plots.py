"""The report's figures: each a function from `RunData` to a matplotlib Figure, and the
flight recorder's picture of a `FlightWindow` (`window_figure`: log10 gradient norm per
layer × step over the window, the incident a red line, the first mover's move a white line
from where it began).

Every figure shows what a plot would otherwise hide: NaN/Inf as red ×, exact zero and "not
logged" apart, steps at their real positions, runs told apart by colour. matplotlib is
imported lazily; plots never touch a tracker.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gradtrack.formats.flight import FlightWindow
from gradtrack.report.compare import Divergence
from gradtrack.report.data import RunData, common_layer_steps

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

NONFINITE_COLOR = "#e00000"  # red × on timelines; NaN cells in heatmaps
INF_COLOR = "#ff00dc"  # ±Inf cells (NaN stays red)
ZERO_COLOR = "#ffffff"  # an exactly-zero gradient: white, below viridis' darkest
MISSING_COLOR = "#c4c4c4"  # not logged: grey
_NO_RED_TAB20 = [i for i in range(20) if i not in (6, 7)]  # keep red for NaN/Inf marks


def run_colors(count: int) -> list[Any]:
    """One colour per run, none of them red (red marks NaN/Inf)."""
    from matplotlib import colormaps

    if count <= 9:
        return [colormaps["tab10"](i) for i in (0, 1, 2, 4, 5, 6, 7, 8, 9)[:count]]
    if count <= len(_NO_RED_TAB20):
        return [colormaps["tab20"](i) for i in _NO_RED_TAB20[:count]]
    return [colormaps["viridis"](x) for x in np.linspace(0, 0.95, count)]


def _figure(width: float = 10.0, height: float = 4.0) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _legend(axes: Axes, entries: int) -> None:
    if entries > 8:  # many runs: a column of names beside the plot, not over it
        axes.legend(
            fontsize=7,
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            ncol=max(1, -(-entries // 24)),
            frameon=False,
        )
    else:
        axes.legend(fontsize=8, loc="best")


def _edge_marks(
    axes: Axes, x: np.ndarray, values: np.ndarray, color: Any, slot: int, labels: set[str]
) -> None:
    """Red × at the top edge where ``values`` are NaN/Inf, a ▽ in the run's colour at the
    bottom edge where they are exactly zero (neither has a place on a log axis)."""
    transform = axes.get_xaxis_transform()  # x in data, y in axes fraction
    bad = ~np.isfinite(values)
    if bad.any():
        label = "NaN/Inf (top edge)" if "bad" not in labels else None
        labels.add("bad")
        axes.scatter(
            x[bad],
            np.full(bad.sum(), 0.96 - 0.012 * (slot % 8)),
            marker="x",
            color=NONFINITE_COLOR,
            s=45,
            linewidths=2,
            transform=transform,
            zorder=5,
            label=label,
            clip_on=False,
        )
    zero = values == 0
    if zero.any():
        label = "exactly 0 (bottom edge)" if "zero" not in labels else None
        labels.add("zero")
        axes.scatter(
            x[zero],
            np.full(zero.sum(), 0.03 + 0.012 * (slot % 8)),
            marker="v",
            facecolors="none",
            edgecolors=[color],
            s=30,
            transform=transform,
            zorder=5,
            label=label,
            clip_on=False,
        )


def _positive(values: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(values) & (values > 0), values, np.nan)


def total_norm(runs: list[RunData], divergences: Sequence[Divergence | None] = ()) -> Figure:
    """Total norm over steps, one colour per run; NaN/Inf and zero marked on the edges;
    a dotted line where each run first parts from the first run."""
    figure = _figure(10.0, 4.5)
    axes = figure.add_subplot()
    colors = run_colors(len(runs))
    labels: set[str] = set()
    for r, run in enumerate(runs):
        logged = run.total_logged_mask()
        steps, values = run.steps[logged], run.total_norm[logged]
        marker = "." if len(steps) <= 300 else None
        axes.plot(
            steps,
            _positive(values),
            label=run.name,
            color=colors[r],
            linewidth=1.2,
            marker=marker,
            markersize=4,
        )
        _edge_marks(axes, steps, values, colors[r], r, labels)
    _divergence_lines(axes, runs, divergences, colors)
    _log_limits(axes, [run.total_norm for run in runs], "no finite, non-zero total norm")
    _step_limits(axes, runs)
    axes.set(yscale="log", xlabel="step", ylabel="total gradient norm", title="Total gradient norm")
    _legend(axes, len(runs) + len(labels))
    axes.grid(alpha=0.3)
    return figure


def _log_limits(axes: Axes, arrays: Sequence[np.ndarray], empty: str) -> None:
    """y limits from the finite positive values alone (the edge marks live in axes
    coordinates and must not stretch a log axis); an honest empty axis if there are none."""
    values = np.concatenate([_positive(a).ravel() for a in arrays]) if arrays else np.array([])
    values = values[np.isfinite(values)]
    if len(values):
        axes.set_ylim(float(values.min()) / 1.6, float(values.max()) * 1.6)
    else:
        axes.set_ylim(0.1, 10)
        axes.text(0.5, 0.5, empty, ha="center", transform=axes.transAxes, color="0.4")


def _step_limits(axes: Axes, runs: list[RunData]) -> None:
    steps = np.concatenate([run.steps for run in runs])
    if len(steps):
        low, high = int(steps.min()), int(steps.max())
        pad = max(1.0, 0.02 * (high - low))
        axes.set_xlim(low - pad, high + pad)


def _divergence_lines(
    axes: Axes, runs: list[RunData], divergences: Sequence[Divergence | None], colors: list[Any]
) -> None:
    for r, divergence in enumerate(divergences):
        if divergence is None or r == 0:
            continue
        label = f"{runs[r].name} parts from {runs[0].name} at step {divergence.step}"
        axes.axvline(divergence.step, color=colors[r], linestyle=":", linewidth=1.5, label=label)


def profile_steps(runs: list[RunData], count: int = 3) -> list[int]:
    """Steps every run logged, spread from first to last."""
    common = common_layer_steps(runs)
    if not common:
        return []
    picks = np.unique(np.linspace(0, len(common) - 1, count).round().astype(int))
    return [common[i] for i in picks]


def _layer_ticks(axes: Axes, layers: list[str], axis: str = "x", most: int = 40) -> None:
    """Every layer's name when they fit; else every k-th, so 200 layers stay readable."""
    every = max(1, -(-len(layers) // most))
    positions = list(range(0, len(layers), every))
    names = [layers[i] for i in positions]
    if axis == "x":
        axes.set_xticks(positions, names, rotation=60, ha="right", fontsize=6)
    else:
        axes.set_yticks(positions, names, fontsize=6)


def flow_profile(runs: list[RunData], steps: list[int]) -> Figure:
    """Per-layer norm by depth, one panel per step, one colour per run."""
    figure = _figure(10.0, 1.0 + 2.8 * max(1, len(steps)))
    colors = run_colors(len(runs))
    layers = runs[0].layers
    shared = None
    for s, step in enumerate(steps or [None]):
        axes = figure.add_subplot(max(1, len(steps)), 1, s + 1, sharex=shared, sharey=shared)
        shared = shared or axes
        axes.tick_params(labelbottom=s == max(1, len(steps)) - 1)
        labels: set[str] = set()
        for r, run in enumerate(runs if step is not None else []):
            row = int(np.searchsorted(run.steps, step or 0))
            cols = [run.layers.index(layer) for layer in layers if layer in run.layers]
            depth = np.array([layers.index(run.layers[c]) for c in cols])
            values = run.norms[row, cols]
            logged = run.logged_mask("grad_norm")[row, cols]
            axes.plot(
                depth,
                _positive(np.where(logged, values, np.nan)),
                color=colors[r],
                marker="." if len(layers) <= 80 else None,
                markersize=4,
                linewidth=1.2,
                label=run.name if s == 0 else None,
            )
            _edge_marks(axes, depth[logged], values[logged], colors[r], r, labels)
        axes.set(yscale="log", ylabel="gradient norm", title=f"step {step}")
        axes.grid(alpha=0.3)
    shown = [run.norms[int(np.searchsorted(run.steps, step))] for run in runs for step in steps]
    _log_limits(axes, shown, "no finite, non-zero layer norm")  # y is shared: every panel
    legend: dict[str, Any] = {}  # one entry per run and per mark, whichever panel drew it
    for panel in figure.axes:
        for handle, label in zip(*panel.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    figure.legend(
        legend.values(),
        legend.keys(),
        loc="outside right upper",
        fontsize=7,
        ncol=max(1, -(-len(legend) // 30)),
        frameon=False,
    )
    _layer_ticks(axes, layers)
    axes.set_xlabel("layer (input → output)")
    figure.suptitle("Gradient flow by depth")
    return figure


def step_edges(steps: np.ndarray) -> np.ndarray:
    """Column edges at the real steps: each column starts at its step and lasts until the
    next one, at most the usual (median) spacing — a longer gap shows as not logged.

    >>> step_edges(np.array([0, 100, 110, 200])).tolist()
    [[0.0, 90.0], [100.0, 110.0], [110.0, 200.0], [200.0, 290.0]]
    """
    steps = steps.astype(float)
    if len(steps) == 1:
        return np.array([[steps[0], steps[0] + 1.0]])
    gaps = np.diff(steps)
    usual = float(np.median(gaps))
    ends = np.append(steps[:-1] + np.minimum(gaps, usual), steps[-1] + usual)
    return np.stack([steps, ends], axis=1)


def _with_gaps(steps: np.ndarray, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x edges and data for one pcolormesh with a column per step at its `step_edges`; the
    spans between columns are empty (masked) cells, showing the axes' "not logged" colour."""
    spans = step_edges(steps)
    x = spans.ravel()  # s0, e0, s1, e1, …: a gap cell between e_i and s_i+1 (often empty)
    filled = np.full((data.shape[0], 2 * data.shape[1] - 1), np.nan)
    filled[:, ::2] = data
    return x, np.ma.masked_invalid(filled)


def log_range(runs: list[RunData]) -> tuple[float, float]:
    """log10 range of every finite non-zero layer norm, shared by the runs' heatmaps."""
    values = np.concatenate([_positive(run.norms).ravel() for run in runs])
    values = values[np.isfinite(values)]
    if not len(values):
        return (-1.0, 1.0)
    low, high = float(np.log10(values.min())), float(np.log10(values.max()))
    return (low, high) if high > low else (low - 0.5, high + 0.5)


def heatmap(
    run: RunData,
    color_range: tuple[float, float] | None = None,
    divergence: Divergence | None = None,
    reference: str = "",
) -> Figure:
    """Layers × steps, colour = log10 norm; NaN red, Inf magenta, zero white, not logged grey;
    columns at their real steps; where the run parts from ``reference``, a dotted line."""
    from matplotlib.colors import ListedColormap

    figure = _figure(10.0, max(3.0, min(12.0, 0.05 * len(run.layers) + 2.0)))
    axes = figure.add_subplot()
    axes.set_facecolor(MISSING_COLOR)  # wherever no cell is drawn: not logged
    rows = run.layer_rows()
    steps = run.steps[rows]
    values = run.norms[rows].T  # [layers, steps]
    logged = run.logged_mask("grad_norm")[rows].T
    low, high = color_range or log_range([run])
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.where(logged & np.isfinite(values) & (values > 0), np.log10(values), np.nan)
    category = np.full(values.shape, np.nan)
    category[logged & np.isnan(values)] = 0
    category[logged & np.isinf(values)] = 1
    category[logged & (values == 0)] = 2
    special = ListedColormap([NONFINITE_COLOR, INF_COLOR, ZERO_COLOR])
    image = None
    y = np.arange(len(run.layers) + 1) - 0.5
    if len(steps):
        x, cells = _with_gaps(steps, logs)
        image = axes.pcolormesh(x, y, cells, cmap="viridis", vmin=low, vmax=high)
        if not np.isnan(category).all():
            x, cells = _with_gaps(steps, category)
            axes.pcolormesh(x, y, cells, cmap=special, vmin=-0.5, vmax=2.5)
    axes.set_ylim(len(run.layers) - 0.5, -0.5)
    if divergence is not None:
        _parting_mark(axes, run, divergence, reference)
    _layer_ticks(axes, run.layers, axis="y", most=50)
    axes.set(
        xlabel="step",
        ylabel="layer (input → output)",
        title=f"{run.name}: log10 gradient norm per layer",
    )
    if image is not None:
        figure.colorbar(image, ax=axes, label="log10 norm", fraction=0.04)
    _cell_legend(figure)
    return figure


def _parting_mark(axes: Axes, run: RunData, divergence: Divergence, reference: str) -> None:
    """A dotted line at the step where ``run`` parts from ``reference``, and the layer that
    parts first named at its row."""
    axes.axvline(divergence.step, color="black", linestyle=":", linewidth=1.5)
    if divergence.layer in run.layers:
        axes.annotate(
            f"parts from {reference} at step {divergence.step}: {divergence.layer}",
            (divergence.layer_step, run.layers.index(divergence.layer)),
            xytext=(6, 0),
            textcoords="offset points",
            fontsize=7,
            va="center",
            bbox={"boxstyle": "round", "fc": "white", "alpha": 0.8},
        )


def _cell_legend(figure: Figure) -> None:
    """What a heatmap's special cells mean: NaN, Inf, exactly 0, not logged."""
    from matplotlib.patches import Patch

    figure.legend(
        handles=[
            Patch(color=c, label=t, ec="0.3")
            for c, t in (
                (NONFINITE_COLOR, "NaN"),
                (INF_COLOR, "Inf"),
                (ZERO_COLOR, "exactly 0"),
                (MISSING_COLOR, "not logged"),
            )
        ],
        fontsize=7,
        loc="outside lower center",
        ncol=4,
        frameon=False,
    )


def shared_bins(runs: list[RunData], layer: str, bins: int = 64) -> np.ndarray | None:
    """One set of bin edges spanning every histogram of ``layer`` in every run."""
    edges = [h.edges for run in runs for _, h in run.histograms.get(layer, [])]
    if not edges:
        return None
    low = min(float(e[0]) for e in edges)
    high = max(float(e[-1]) for e in edges)
    return np.linspace(low, high if high > low else low + 1.0, bins + 1)


def rebin(edges: np.ndarray, counts: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Counts moved onto ``target`` edges, spread evenly within each source bin.

    >>> rebin(np.array([0.0, 2.0]), np.array([4]), np.array([0.0, 1.0, 2.0, 3.0])).tolist()
    [2.0, 2.0, 0.0]
    """
    cumulative = np.concatenate([[0.0], np.cumsum(counts, dtype=float)])
    return np.diff(np.interp(target, edges, cumulative))


def histogram_evolution(runs: list[RunData], layer: str) -> Figure:
    """Per run, a bins × steps heatmap of one layer's gradient distribution; every panel
    on the same value axis and colour scale."""
    from matplotlib.colors import LogNorm

    columns = min(len(runs), 4)
    rows = -(-len(runs) // columns)
    figure = _figure(10.0, 0.8 + 2.6 * rows)
    target = shared_bins(runs, layer)
    first = None
    panels = []
    for r, run in enumerate(runs):
        axes = figure.add_subplot(rows, columns, r + 1, sharey=first)
        first = first or axes
        series = run.histograms.get(layer, [])
        axes.set_title(run.name, fontsize=9)
        if not series or target is None:
            axes.text(0.5, 0.5, "no histograms", ha="center", transform=axes.transAxes)
            continue
        steps = np.array([step for step, _ in series])
        fractions = np.stack(
            [rebin(h.edges, h.counts, target) / max(1, h.sample_size) for _, h in series], axis=1
        )
        panels.append((axes, steps, fractions))
        axes.set_facecolor(MISSING_COLOR)
        axes.set_xlabel("step", fontsize=8)
    positive = [f[f > 0] for *_, f in panels if (f > 0).any()]
    floor = min((float(p.min()) for p in positive), default=1e-4)
    norm = LogNorm(vmin=floor, vmax=1.0)
    image = None
    for axes, steps, fractions in panels:
        assert target is not None  # panels exist only where there are histograms
        # An empty bin is below the colour scale (black), not "no histogram" (grey).
        x, cells = _with_gaps(steps, np.where(fractions > 0, fractions, 1e-300))
        image = axes.pcolormesh(x, target, cells, cmap="magma", norm=norm)
    scale = next((h.scale for run in runs for _, h in run.histograms.get(layer, [])), "linear")
    if first is not None:
        first.set_ylabel("log10 |g|" if scale == "log" else "gradient value")
    if image is not None:
        figure.colorbar(image, ax=figure.axes, label="fraction of sample", fraction=0.03)
    figure.suptitle(f"Gradient distribution over steps: {layer} (grey: no histogram)")
    return figure


def alert_timeline(runs: list[RunData], divergences: Sequence[Divergence | None] = ()) -> Figure:
    """Alerts per run over steps: marker shape = rule, colour = severity, each rule named
    at its first alert in a run (with the NaN/Inf origin layer)."""
    from matplotlib.lines import Line2D

    figure = _figure(10.0, 1.6 + 0.4 * len(runs))
    axes = figure.add_subplot()
    colors = {"info": "C0", "warning": "C1", "error": NONFINITE_COLOR}
    shapes = ["o", "s", "^", "D", "P", "v", "*", "h"]
    rules = sorted({a.rule for run in runs for a in run.alerts})
    shape = {rule: shapes[i % len(shapes)] for i, rule in enumerate(rules)}
    for r, run in enumerate(runs):
        named: set[str] = set()
        for alert in sorted(run.alerts, key=lambda a: a.step):
            axes.scatter(
                alert.step,
                r,
                marker=shape[alert.rule],
                s=45,
                zorder=3,
                color=colors.get(alert.severity, "C7"),
                edgecolors="black",
                linewidths=0.5,
            )
            if alert.rule not in named:
                named.add(alert.rule)
                text = alert.rule + (f" @ {alert.origin_layer}" if alert.origin_layer else "")
                axes.annotate(
                    text, (alert.step, r), xytext=(4, 6), textcoords="offset points", fontsize=7
                )
    for r, divergence in enumerate(divergences):
        if divergence is not None and r > 0:
            axes.scatter(divergence.step, r, marker="|", s=300, color="black", zorder=4)
    handles = [
        Line2D([], [], marker=shape[rule], linestyle="", color="0.5", label=rule) for rule in rules
    ]
    handles += [
        Line2D([], [], marker="o", linestyle="", color=c, label=s) for s, c in colors.items()
    ]
    if any(d is not None for d in divergences):
        handles.append(
            Line2D(
                [],
                [],
                marker="|",
                linestyle="",
                color="black",
                markersize=12,
                label="parts from the first run",
            )
        )
    axes.legend(
        handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False
    )
    axes.set_yticks(range(len(runs)), [run.name for run in runs], fontsize=8)
    axes.set_ylim(len(runs) - 0.4, -0.6)
    _step_limits(axes, runs)
    axes.set(xlabel="step", title="Alerts (shape: rule, colour: severity)")
    axes.grid(alpha=0.3, axis="x")
    return figure


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
        f"{window.incident} at step {window.incident_step}",
        (window.incident_step, -0.5),
        xytext=(-4, -4),
        textcoords="offset points",
        ha="right",
        va="top",
        fontsize=7,
        bbox={"boxstyle": "round", "fc": "white", "alpha": 0.8},
    )
    if window.first_mover in layers and window.first_mover_step is not None:
        row = layers.index(window.first_mover)
        axes.plot(
            [window.first_mover_step - 0.5, window.incident_step - 0.5],
            [row, row],
            color="white",
            linewidth=2.0,
        )
        axes.annotate(
            f"first mover: {window.first_mover}, from step {window.first_mover_step}",
            (window.first_mover_step, row),
            xytext=(-6, 8),
            textcoords="offset points",
            ha="right",
            fontsize=7,
            bbox={"boxstyle": "round", "fc": "white", "alpha": 0.8},
        )
    axes.set_ylim(len(layers) - 0.5, -0.5)
    _layer_ticks(axes, layers, axis="y", most=50)
    axes.set(
        xlabel="step",
        ylabel="layer (input → output)",
        title=title
        or f"gradient norms before the {window.incident} at step "
        f"{window.incident_step} (flight recorder)",
    )
    if image is not None:
        figure.colorbar(image, ax=axes, label="log10 norm", fraction=0.04)
    return figure


def draw_window(window: FlightWindow, path: Path, title: str = "") -> Path:
    """The window's picture as a PNG at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    window_figure(window, title).savefig(path)
    return path
