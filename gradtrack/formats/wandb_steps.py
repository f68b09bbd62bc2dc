"""gradtrack's step files in a W&B run: every logged step, one JSON line each, and their reader.

A run's history rows carry one value per key, and in a run the user logs to gradtrack places a
step only where the user commits a row; so every step also goes, losslessly, into files the run
carries (``run.dir/gradtrack/steps[/<model_name>]/steps-<first step>.jsonl``, uploaded live).
A line is ``{"step": s, "metrics": {key: value}, "histograms": {key: {...}}}`` with the same
keys as the history rows (`gradtrack.formats.metrics`); NaN and ±Inf are JSON's
``NaN``/``Infinity`` extensions, which Python's ``json`` reads back.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from gradtrack.formats.histogram import Histogram

STEPS_DIR = PurePosixPath("gradtrack", "steps")  # inside the run's files
PART_PREFIX = "steps-"
PART_SUFFIX = ".jsonl"


def steps_dir(model_name: str | None) -> PurePosixPath:
    """Where a watcher's step files go inside the run's files.

    >>> str(steps_dir(None)), str(steps_dir("critic"))
    ('gradtrack/steps', 'gradtrack/steps/critic')
    """
    return STEPS_DIR / model_name if model_name else STEPS_DIR


def part_name(first_step: int) -> str:
    """A step file's name: sorted by name is sorted by step.

    >>> part_name(1200)
    'steps-000001200.jsonl'
    """
    return f"{PART_PREFIX}{first_step:09d}{PART_SUFFIX}"


def is_part(path: str | PurePosixPath) -> bool:
    """A step file of gradtrack's, given its path inside the run's files.

    >>> is_part("gradtrack/steps/steps-000000000.jsonl"), is_part("gradtrack/other.json")
    (True, False)
    """
    posix = PurePosixPath(str(path).replace("\\", "/"))
    return (
        posix.parts[:2] == STEPS_DIR.parts
        and posix.name.startswith(PART_PREFIX)
        and posix.name.endswith(PART_SUFFIX)
    )


def step_line(step: int, metrics: Mapping[str, float], histograms: Mapping[str, Histogram]) -> str:
    """One step as one line of JSON (ending in a newline).

    >>> step_line(3, {"grad/total_norm": float("inf")}, {})
    '{"step": 3, "metrics": {"grad/total_norm": Infinity}}\\n'
    """
    line: dict[str, Any] = {"step": step, "metrics": dict(metrics)}
    if histograms:
        line["histograms"] = {
            key: {
                "edges": h.edges.tolist(),
                "counts": h.counts.tolist(),
                "scale": h.scale,
                "zeros": h.zeros,
            }
            for key, h in histograms.items()
        }
    return json.dumps(line, separators=(", ", ": ")) + "\n"


Series = dict[str, list[tuple[int, float]]]
HistogramSeries = dict[str, list[tuple[int, Histogram]]]


def read_parts(texts: Iterable[str]) -> tuple[Series, HistogramSeries]:
    """``{metric key: [(step, value)]}`` and ``{histogram key: [(step, Histogram)]}``, in step
    order, from the step files' texts. A step written twice counts once; a last line cut off
    (the run was read while gradtrack wrote) is left out."""
    steps: dict[int, dict[str, Any]] = {}
    for text in texts:
        for raw in text.splitlines():
            try:
                line = json.loads(raw)
            except json.JSONDecodeError:
                continue
            steps[int(line["step"])] = line
    series: Series = {}
    histograms: HistogramSeries = {}
    for step in sorted(steps):
        line = steps[step]
        for key, value in line.get("metrics", {}).items():
            series.setdefault(key, []).append((step, _number(value)))
        for key, h in line.get("histograms", {}).items():
            histogram = Histogram(
                np.asarray(h["edges"], np.float64), np.asarray(h["counts"], np.int64),
                h.get("scale", "linear"), int(h.get("zeros", 0)),
            )  # fmt: skip
            histograms.setdefault(key, []).append((step, histogram))
    return series, histograms


def read_dir(files_dir: Path) -> tuple[Series, HistogramSeries] | None:
    """What the step files under a run's files folder hold (each watcher's folder read on its
    own: two models number their steps apart); None: the run has none."""
    paths = sorted((files_dir / STEPS_DIR).rglob(f"{PART_PREFIX}*{PART_SUFFIX}"))
    if not paths:
        return None
    return merge(
        read_parts(path.read_text(encoding="utf-8") for path in paths if path.parent == folder)
        for folder in sorted({path.parent for path in paths})
    )


def merge(
    parts: Iterable[tuple[Series, HistogramSeries]],
) -> tuple[Series, HistogramSeries]:
    """The series of several watchers (their keys differ by ``model_name``) as one."""
    series: Series = {}
    histograms: HistogramSeries = {}
    for more_series, more_histograms in parts:
        for key, values in more_series.items():
            series.setdefault(key, []).extend(values)
        for key, entries in more_histograms.items():
            histograms.setdefault(key, []).extend(entries)
    return series, histograms


def _number(value: Any) -> float:
    return float(value) if value is not None else math.nan
