"""The requests one batch of the MLflow sink becomes: `log-batch` calls within MLflow's
per-request limits, then the files to upload — in the order they must reach the run."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gradtrack.sinks.mlflow_tracking import (
    MAX_ITEMS_PER_BATCH,
    MAX_METRICS_PER_BATCH,
    MAX_TAGS_PER_BATCH,
)

Metric = tuple[str, float, int, int]  # key, value, timestamp (ms), step
Tag = tuple[str, str]


@dataclass
class LogBatch:
    metrics: list[Metric] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)  # one value per key: the last

    def room(self) -> int:
        return min(
            MAX_METRICS_PER_BATCH - len(self.metrics),
            MAX_ITEMS_PER_BATCH - len(self.metrics) - len(self.tags),
        )


@dataclass(frozen=True)
class Upload:
    path: Path
    artifact_dir: str


Request = LogBatch | Upload


def pack(steps: Iterable[tuple[list[Metric], list[Tag]]]) -> list[LogBatch]:
    """Each step's metrics and tags, in order, into as few `log-batch` requests as the
    limits allow (a step larger than one request spans several; its tags go with its
    first part). Tags of one key keep their last value."""
    requests = [LogBatch()]
    for metrics, tags in steps:
        for key, value in tags:
            current = requests[-1]
            full = len(current.tags) >= MAX_TAGS_PER_BATCH or current.room() <= 0
            if full and key not in current.tags:
                requests.append(current := LogBatch())
            current.tags[key] = value
        while metrics:
            current = requests[-1]
            room = current.room()
            if room <= 0:
                requests.append(current := LogBatch())
                room = current.room()
            current.metrics.extend(metrics[:room])
            metrics = metrics[room:]
    return [request for request in requests if request.metrics or request.tags]
