"""gradtrack's data in a W&B run, and the readers that load it back.

Names beyond the metric keys: the histogram and picture families, the profile chart, and the
config entry that keeps the layer order for readers.

Step files: a run's history rows carry one value per key, and in a run the user logs to
gradtrack places a step only where the user commits a row; so every step also goes,
losslessly, into files the run carries (``run.dir/gradtrack/steps[/<model_name>]/steps-<first
step>.jsonl``, uploaded live). A line is ``{"step": s, "metrics": {key: value}, "histograms":
{key: {...}}}`` with the same keys as the history rows (`gradtrack.formats.metrics`); NaN and
±Inf are JSON's ``NaN``/``Infinity`` extensions, which Python's ``json`` reads back.

The offline run's transaction log (``run-*.wandb``), read record by record: W&B has no public
reader of it, so its framing is parsed here — 32 KiB blocks of chunks (crc32, length, type)
after a 7-byte header, each record a ``wandb_internal_pb2`` protobuf (checked against W&B's
own inspector in tests/test_private_apis.py).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from gradtrack.errors import GradtrackError, require_module
from gradtrack.formats.histogram import Histogram

HIST_FAMILY = "grad_hist"
PICTURES_FAMILY = "grad_pictures"  # summary images: grad_pictures/<name>
LAYERS_CONFIG_KEY = "gradtrack_layers"  # layer names in depth order, for readers
PROFILE_FAMILY = "grad_profile"


# -- step files -----------------------------------------------------------------------------
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
            edges = np.asarray(h["edges"], np.float64)
            counts = np.asarray(h["counts"], np.int64)
            histogram = Histogram(edges, counts, h.get("scale", "linear"), int(h.get("zeros", 0)))
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


# -- the offline run's transaction log ------------------------------------------------------
_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def find_run_file(path: Path) -> Path:
    """The ``run-*.wandb`` file of an offline run directory (or the file itself)."""
    if path.is_file() and path.suffix == ".wandb":
        return path
    files = sorted(path.glob("run-*.wandb")) if path.is_dir() else []
    if len(files) != 1:
        found = sorted(p.name for p in path.iterdir())[:10] if path.is_dir() else "nothing"
        raise GradtrackError(
            f"{path} is not a W&B run directory (no single run-*.wandb file; found: {found})"
        )
    return files[0]


def iter_records(path: Path) -> Iterator[Any]:
    """Every protobuf record in a ``.wandb`` file, in order."""
    require_module("wandb", "wandb")
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise GradtrackError(f"{path} is not a W&B transaction log")
    pos, payload = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # the rest of a block too small for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0:
            break
        payload += data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            record.ParseFromString(payload)
            payload = b""
            yield record
