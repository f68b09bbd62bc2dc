"""Writes the report: PNG files and one self-contained HTML page that embeds them."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import TYPE_CHECKING

from gradtrack.formats import write_atomic
from gradtrack.report import plots
from gradtrack.report.compare import Divergence, LayerDifference, Summary, sentences, summarise
from gradtrack.report.data import RunData

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def render_report(
    runs: list[RunData],
    out_dir: Path,
    hist_layers: list[str] | None = None,
    summary: Summary | None = None,
) -> Path:
    """Draw every figure for ``runs`` into ``out_dir``; return the HTML file's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summary or summarise(runs)
    if hist_layers is None:
        hist_layers = _default_hist_layers(runs)
    figures = _figures(runs, hist_layers, summary.divergence_from_first())
    figures += _window_figures(runs)
    sections = [_section(name, title, figure, out_dir) for name, title, figure in figures]
    page = _PAGE.format(
        title=html.escape(" vs ".join(run.name for run in runs)),
        findings="".join(f"<li>{html.escape(line)}</li>" for line in sentences(summary)),
        runs=_runs_table(runs),
        ranking=_ranking_table(summary),
        ranking_title="Layers whose gradient flow differs most"
        if len(runs) > 1
        else "Layers, weakest gradient flow first",
        rtol=summary.rtol,
        sections="\n".join(sections),
        alerts=_alerts_table(runs),
    )
    # A report opened in a browser and rewritten by the next `gradtrack report` is never torn.
    return write_atomic(out_dir / "report.html", page, fsync=False)


def _default_hist_layers(runs: list[RunData]) -> list[str]:
    """The first, middle and last layer with histograms in every run."""
    shared = [layer for layer in runs[0].layers if all(layer in r.layers for r in runs)]
    with_hist = [layer for layer in shared if all(layer in r.histograms for r in runs)]
    if not with_hist:
        return []
    return [with_hist[i] for i in sorted({0, len(with_hist) // 2, len(with_hist) - 1})]


def _figures(
    runs: list[RunData], hist_layers: list[str], divergences: list[Divergence | None]
) -> list[tuple[str, str, Figure]]:
    """Every figure of the report, in page order: (file name, title, figure)."""
    steps = plots.profile_steps(runs)
    color_range = plots.log_range(runs)
    figures: list[tuple[str, str, Figure]] = [
        ("total_norm", "Total gradient norm over steps", plots.total_norm(runs, divergences)),
        (
            "flow_profile",
            f"Gradient-flow profile at steps {steps}",
            plots.flow_profile(runs, steps),
        ),
    ]
    figures += [
        (
            f"heatmap_{i}",
            f"Layers × steps: {run.name}",
            plots.heatmap(run, color_range, divergences[i], runs[0].name),
        )
        for i, run in enumerate(runs)
    ]
    figures += [
        (f"histograms_{i}", f"Histogram evolution: {layer}", plots.histogram_evolution(runs, layer))
        for i, layer in enumerate(hist_layers)
    ]
    figures.append(("alerts", "Alert timeline", plots.alert_timeline(runs, divergences)))
    return figures


def _window_figures(runs: list[RunData], most: int = 6) -> list[tuple[str, str, Figure]]:
    """The flight recorder's windows: each run's first ``most``, its first mover named."""
    figures = []
    for i, run in enumerate(runs):
        for window in run.windows[:most]:
            title = (
                f"{run.name}: every layer's norm before the {window.incident} at step "
                f"{window.incident_step} (flight recorder)"
            )
            name = f"flight_{i}_{window.incident_step}"
            figures.append((name, title, plots.window_figure(window, title)))
    return figures


def _section(name: str, title: str, figure: Figure, out_dir: Path) -> str:
    """Write the figure's PNG into ``out_dir``; its section of the page, the PNG embedded."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    figure.clear()  # a report of many runs draws many figures: free each one now
    write_atomic(out_dir / f"{name}.png", buffer.getvalue(), fsync=False)
    encoded = base64.b64encode(buffer.getvalue()).decode()
    return (
        f'<section><h2>{html.escape(title)}</h2><img alt="{html.escape(title)}" '
        f'src="data:image/png;base64,{encoded}"></section>'
    )


def _runs_table(runs: list[RunData]) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(r.name)}</td><td>{html.escape(r.source)}</td>"
        f"<td>{len(r.steps)} ({r.steps[0]}–{r.steps[-1]})</td><td>{len(r.layers)}</td></tr>"
        for r in runs
    )
    head = "<tr><th>run</th><th>source</th><th>logged steps</th><th>layers</th></tr>"
    return f"<table>{head}{rows}</table>"


def _ranking_table(summary: Summary, limit: int = 25) -> str:
    runs, ranked = summary.runs, summary.ranking[:limit]
    if len(runs) == 1:
        return _layers_table(ranked)
    head = "".join(f"<th>mean log10 norm: {html.escape(r.name)}</th>" for r in runs)
    what = "spread between runs" if len(runs) > 1 else "below the strongest layer"
    rows = "".join(
        f"<tr><td>{i + 1}</td><td>{html.escape(d.layer)}</td>"
        f"<td>{_KIND_WORDS.get(d.kind or '', '')}</td><td>{_step(d.first_step)}</td>"
        + "".join(f"<td>{m:.2f}</td>" for m in d.mean_log10_norm)
        + f"<td>{d.spread:.2f}</td></tr>"
        for i, d in enumerate(ranked)
    )
    return (
        "<table class=rank><tr><th>#</th><th>layer</th><th>strongest difference</th>"
        f"<th>first differs at step</th>{head}<th>{what} (decades)</th></tr>{rows}</table>"
    )


def _layers_table(ranked: list[LayerDifference]) -> str:
    """One run: its layers, weakest first, and how far below the strongest each sits."""
    rows = "".join(
        f"<tr><td>{i + 1}</td><td>{html.escape(d.layer)}</td>"
        f"<td>{ {'nonfinite': 'NaN/Inf', 'zero': 'exactly 0'}.get(d.kind or '', '') }</td>"
        + "".join(f"<td>{m:.2f}</td>" for m in d.mean_log10_norm)
        + f"<td>{d.spread:.2f}</td></tr>"
        for i, d in enumerate(ranked)
    )
    return (
        "<table class=rank><tr><th>#</th><th>layer</th><th>NaN/Inf or zero</th>"
        f"<th>mean log10 norm</th><th>below the strongest layer (decades)</th></tr>{rows}</table>"
    )


_KIND_WORDS = {
    "nonfinite": "NaN/Inf in one run",
    "zero": "exactly 0 in one run",
    "value": "value beyond tolerance",
}


def _step(step: int | None) -> str:
    return "—" if step is None else str(step)


def _alerts_table(runs: list[RunData]) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(r.name)}</td><td>{a.step}</td><td>{a.severity}</td><td>{a.rule}</td>"
        f"<td>{html.escape(a.message)}</td></tr>"
        for r in runs
        for a in r.alerts
    )
    if not rows:
        return "<p>No alerts.</p>"
    head = "<tr><th>run</th><th>step</th><th>severity</th><th>rule</th><th>message</th></tr>"
    return f"<table>{head}{rows}</table>"


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>gradtrack: {title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }}
th {{ background: #f3f3f3; }} img {{ max-width: 100%; }}
</style></head><body>
<h1>Gradient flow: {title}</h1>
<h2>Findings</h2>
<ul class=findings>{findings}</ul>
<p class=note>Statistics differ when they are more than {rtol:g} apart, relative to the larger
(0: exact); NaN, Inf and exact zero differ from any other value. In the pictures NaN/Inf are
red ×, exact zero a ▽ at the bottom edge (white in heatmaps), and not logged is grey.</p>
{runs}
<h2>{ranking_title}</h2>
{ranking}
{sections}
<h2>Alerts</h2>
{alerts}
</body></html>
"""
