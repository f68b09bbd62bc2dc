"""Reads a run gradtrack logged to TensorBoard: a log dir's event files, through TensorBoard's
own reader (``EventAccumulator``), every event kept (its default keeps a sample)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gradtrack.errors import GradtrackError
from gradtrack.extras import require_module
from gradtrack.formats.histogram import Histogram
from gradtrack.formats.keys import FAMILIES
from gradtrack.formats.tensorboard import (
    ALERTS_TAG,
    EVENTS_GLOB,
    HIST_FAMILY,
    LAYERS_TAG,
    histogram_from_buckets,
    parse_alert_line,
)
from gradtrack.report.data import Alert, Progress, RunData, from_series, parse_alert_text

_SCALAR_FAMILIES = {*FAMILIES} - {"act_grad_norm"}


def is_log_dir(path: Path) -> bool:
    """A folder holding TensorBoard event files (directly, as one run)."""
    return path.is_dir() and any(path.glob(EVENTS_GLOB))


def load_events(path: Path) -> Any:
    """TensorBoard's ``EventAccumulator`` over ``path``, loaded, with every event kept and
    none purged (two alerts at one step are both alerts)."""
    require_module("tensorboard", "tensorboard")
    from tensorboard.backend.event_processing import event_accumulator as ea

    keep_all = {kind: 0 for kind in (ea.SCALARS, ea.HISTOGRAMS, ea.TENSORS, ea.IMAGES)}
    accumulator = ea.EventAccumulator(str(path), size_guidance=keep_all, purge_orphaned_data=False)
    accumulator.Reload()
    return accumulator


def read_tensorboard_dir(path: Path, progress: Progress | None = None) -> RunData:
    if not is_log_dir(path):
        raise GradtrackError(f"{path} is not a TensorBoard log dir (no event files in it)")
    events = load_events(path)
    tags = events.Tags()
    series: dict[str, list[tuple[int, float]]] = {}
    scalar_tags = [t for t in (*tags["scalars"], *tags["tensors"]) if _is_metric(t)]
    for i, tag in enumerate(scalar_tags):
        series[tag] = scalar_series(events, tag)
        if progress is not None:
            progress(f"reading {path.name}", i + 1, len(scalar_tags))
    histograms = {
        tag.removeprefix(f"{HIST_FAMILY}/"): histogram_series(events, tag)
        for tag in tags["histograms"]
        if tag.startswith(f"{HIST_FAMILY}/")
    }
    return from_series(
        name=path.name,
        source=f"TensorBoard log dir {path}",
        series=series,
        layer_order=_layer_order(events),
        histograms=histograms,
        alerts=_alerts(events),
        run_id=str(path),
    )


def _is_metric(tag: str) -> bool:
    family = tag.partition("/")[0]
    return family in _SCALAR_FAMILIES or tag == "gradtrack/dropped"


def scalar_series(events: Any, tag: str) -> list[tuple[int, float]]:
    """``[(step, value)]`` of a scalar: a double tensor summary, or an old float32 one."""
    from tensorboard.util import tensor_util

    if tag in events.Tags()["scalars"]:
        return [(e.step, float(e.value)) for e in events.Scalars(tag)]
    return [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)]


def histogram_series(events: Any, tag: str) -> list[tuple[int, Histogram]]:
    """``[(step, Histogram)]`` of a raw histogram, its buckets as they are stored."""
    return [
        (e.step, histogram_from_buckets(e.histogram_value.min, list(e.histogram_value.bucket_limit),
                                        list(e.histogram_value.bucket)))
        for e in events.Histograms(tag)
    ]  # fmt: skip


def _texts(events: Any, tag: str) -> list[tuple[int, str]]:
    """A text summary's ``[(step, text)]``; torch's writer files ``tag`` as
    ``<tag>/text_summary``."""
    from tensorboard.util import tensor_util

    found: list[tuple[int, str]] = []
    names = [name for name in (tag, f"{tag}/text_summary") if name in events.Tags()["tensors"]]
    for event in (e for name in names for e in events.Tensors(name)):
        for value in tensor_util.make_ndarray(event.tensor_proto).reshape(-1):
            found.append((event.step, value.decode("utf-8") if isinstance(value, bytes) else value))
    return found


def _layer_order(events: Any) -> list[str]:
    texts = _texts(events, LAYERS_TAG)
    return list(json.loads(texts[-1][1])) if texts else []


def _alerts(events: Any) -> list[Alert]:
    alerts = []
    for _step, text in _texts(events, ALERTS_TAG):
        parsed = parse_alert_line(text)
        if parsed is not None:
            severity, rule, rest = parsed
            alerts.append(parse_alert_text(rest, rule, severity))
    return alerts
