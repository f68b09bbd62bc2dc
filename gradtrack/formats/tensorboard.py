"""gradtrack's names in a TensorBoard log dir: scalar tags are the metric keys, histograms
``grad_hist/<layer>`` (gradtrack's own bins), alerts and the layer order as text summaries,
pictures ``grad_pictures/<name>`` as images; and how a `Histogram` becomes a raw one."""

from __future__ import annotations

import json
import re
import socket
from datetime import datetime
from pathlib import Path

import numpy as np

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
