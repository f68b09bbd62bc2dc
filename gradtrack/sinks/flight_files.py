"""What a tracker sink writes for a flight recorder's window (`gradtrack.formats.flight`):
its file and picture, staged in a folder, and its ``grad_norm/<layer>`` series.

MLflow takes past steps in any order, so the window's steps also go out as series (up to
``flight.series_max_values``: MLflow stores each value as a row); W&B's history takes only
increasing steps, so a W&B run keeps the file and the picture.
"""

from __future__ import annotations

from pathlib import Path

from gradtrack.formats.atomic import write_atomic
from gradtrack.formats.flight import FlightWindow, window_name, window_text
from gradtrack.formats.keys import LAYER_KEY_PREFIX, metric_key
from gradtrack.log import report


def stage_window(window: FlightWindow, folder: Path, title: str = "") -> list[Path]:
    """The window's JSON file and, where matplotlib is installed, its PNG, in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / window_name(window)
    write_atomic(path, window_text(window), fsync=False)
    paths = [path]
    from gradtrack.report.live import can_draw

    if can_draw():
        from gradtrack.report.flight import draw_window

        try:
            paths.append(draw_window(window, path.with_suffix(".png"), title))
        except Exception as exc:  # a picture must not cost the window
            report(f"gradtrack could not draw the flight window's picture: {exc!r}")
    return paths


def window_series(window: FlightWindow, model_name: str | None) -> list[tuple[str, float, int]]:
    """``(grad_norm/<layer>, norm, step)`` for every step of the window whose per-layer norms
    did not reach the tracker yet (0 where the layer had no gradient at that step)."""
    prefix = LAYER_KEY_PREFIX["norm"]
    keys = [metric_key(prefix, layer, model_name) for layer in window.layers]
    logged = window.logged if len(window.logged) == len(window.steps) else None
    series = []
    for i, (step, row) in enumerate(zip(window.steps.tolist(), window.norms.tolist())):
        if logged is not None and logged[i]:
            continue
        series += [(key, value, step) for key, value in zip(keys, row)]
    return series
