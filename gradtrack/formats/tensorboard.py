"""gradtrack's data in a TensorBoard log dir, and the readers that load it back.

Scalar tags are the metric keys, histograms ``grad_hist/<layer>`` (gradtrack's own bins),
alerts and the layer order as text summaries, pictures ``grad_pictures/<name>`` as images;
here too how a `Histogram` becomes a raw one and back. A log dir is read through
TensorBoard's own reader (``EventAccumulator``, `load_events`), every event kept (its default
keeps a sample).
"""

from __future__ import annotations

import json
import re
import socket
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from gradtrack.errors import require_module
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.histogram import Histogram
from gradtrack.formats.wandb import HIST_FAMILY, PICTURES_FAMILY

__all__ = ["HIST_FAMILY", "PICTURES_FAMILY"]

ALERTS_TAG = "gradtrack/alerts"
LAYERS_TAG = "gradtrack/layers"  # layer names in depth order (JSON), for readers
EVENTS_GLOB = "*tfevents*"
_ALERT_LINE = re.compile(r"(\w+) · (\S+) · (step \d+: .*)", re.S)


def default_log_dir() -> Path:
    """``runs/<date>_<host>``, as `torch.utils.tensorboard.SummaryWriter` names its default."""
    return Path("runs", datetime.now().strftime("%b%d_%H-%M-%S") + "_" + socket.gethostname())


def raw_histogram(histogram: Histogram) -> dict[str, object]:
    """``add_histogram_raw``'s arguments for gradtrack's bins: TensorBoard keeps each bucket's
    right edge (``bucket_limits``) and the lowest edge as ``min``, so its buckets are exactly
    these bins with these counts. ``sum`` and ``sum_squares`` use the bin centres (the samples
    are gone); with ``scale="log"`` the bins are over log10 |g|.

    >>> h = Histogram(np.array([0.0, 1.0, 2.0]), np.array([3, 1]))
    >>> raw = raw_histogram(h)
    >>> raw["bucket_limits"], raw["bucket_counts"], raw["min"], raw["max"], raw["num"]
    ([1.0, 2.0], [3, 1], 0.0, 2.0, 4)
    """
    edges = histogram.edges.astype(np.float64)
    counts = histogram.counts.astype(np.int64)
    centres = (edges[:-1] + edges[1:]) / 2
    return {
        "min": float(edges[0]),
        "max": float(edges[-1]),
        "num": int(counts.sum()),
        "sum": float((centres * counts).sum()),
        "sum_squares": float((centres**2 * counts).sum()),
        "bucket_limits": edges[1:].tolist(),
        "bucket_counts": counts.tolist(),
    }


def histogram_from_buckets(lowest: float, limits: list[float], counts: list[float]) -> Histogram:
    """The `Histogram` a raw one holds: edges ``lowest, *limits``."""
    edges = np.asarray([lowest, *limits], np.float64)
    return Histogram(edges, np.asarray(counts, np.float64).round().astype(np.int64))


def alert_text(event: AlertEvent) -> str:
    """One alert as the text summary's line: ``severity · rule · step N: message``."""
    return f"{event.severity} · {event.rule} · step {event.step}: {event.message}"


def parse_alert_line(text: str) -> tuple[str, str, str] | None:
    """``(severity, rule, "step N: message")`` from an `alert_text` line.

    >>> parse_alert_line("warning · explode · step 4: grad norm 9 > 5")
    ('warning', 'explode', 'step 4: grad norm 9 > 5')
    """
    match = _ALERT_LINE.fullmatch(text.strip())
    return (match.group(1), match.group(2), match.group(3)) if match else None


def layers_text(layers: list[str]) -> str:
    return json.dumps(layers)


# -- reading a log dir -----------------------------------------------------------------------
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


def scalar_series(events: Any, tag: str) -> list[tuple[int, float]]:
    """``[(step, value)]`` of a scalar: a double tensor summary, or an old float32 one."""
    from tensorboard.util import tensor_util

    if tag in events.Tags()["scalars"]:
        return [(e.step, float(e.value)) for e in events.Scalars(tag)]
    return [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)]


def histogram_series(events: Any, tag: str) -> list[tuple[int, Histogram]]:
    """``[(step, Histogram)]`` of a raw histogram, its buckets as they are stored."""
    series = []
    for event in events.Histograms(tag):
        stored = event.histogram_value
        histogram = histogram_from_buckets(
            stored.min, list(stored.bucket_limit), list(stored.bucket)
        )
        series.append((event.step, histogram))
    return series


def texts(events: Any, tag: str) -> list[tuple[int, str]]:
    """A text summary's ``[(step, text)]``; torch's writer files ``tag`` as
    ``<tag>/text_summary``."""
    from tensorboard.util import tensor_util

    found: list[tuple[int, str]] = []
    names = [name for name in (tag, f"{tag}/text_summary") if name in events.Tags()["tensors"]]
    for event in (e for name in names for e in events.Tensors(name)):
        for value in tensor_util.make_ndarray(event.tensor_proto).reshape(-1):
            found.append((event.step, value.decode("utf-8") if isinstance(value, bytes) else value))
    return found


def layer_order(events: Any) -> list[str]:
    """The layer order the log dir holds (the last one written); empty if none."""
    found = texts(events, LAYERS_TAG)
    return list(json.loads(found[-1][1])) if found else []
