"""What the MLflow sink still owes its run, oldest first: steps' metrics and tags, and files.

Steps go out as `log-batch` requests of several steps within MLflow's per-request limits; a
file is uploaded once, however often it changes before it goes out. Every entry carries the
number of the first item handed to the sink that sending it completes, so the sink can say
how many items MLflow has.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import NamedTuple

from gradtrack.log import warn
from gradtrack.sinks.mlflow_tracking import (
    MAX_ITEMS_PER_BATCH,
    MAX_METRICS_PER_BATCH,
    MAX_TAGS_PER_BATCH,
)

Metric = tuple[str, float, int, int]  # key, value, timestamp (ms), step
Tag = tuple[str, str]


class PendingStep:
    """One step's metrics and tags waiting to be sent; ``sent`` counts metrics already out;
    ``item`` is the (first) item handed to the sink that sending it completes."""

    __slots__ = ("item", "metrics", "sent", "tags")

    def __init__(self, metrics: list[Metric], tags: list[Tag], item: int) -> None:
        self.metrics, self.tags, self.sent, self.item = metrics, tags, 0, item


class Upload(NamedTuple):
    path: Path
    artifact_dir: str
    item: int | None  # the first handed item whose data the file holds (None: derived data)


Plan = list[tuple[PendingStep, int, bool]]


class Outbox:
    """Steps and files waiting for MLflow; at most ``max_steps`` steps, the oldest dropped
    (and counted in ``dropped``) to make room."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self.steps: deque[PendingStep] = deque()
        self.uploads: deque[Upload] = deque()
        self.dropped = 0

    def add_step(self, metrics: list[Metric], tags: list[Tag], item: int) -> None:
        self.steps.append(PendingStep(metrics, tags, item))

    def make_room(self) -> None:
        """Drop the oldest steps until one more fits."""
        while len(self.steps) >= self.max_steps:
            self.steps.popleft()
            self.dropped += 1
            if self.dropped == 1:
                warn(
                    f"gradtrack's MLflow buffer is full ({self.max_steps} steps):"
                    " dropping the oldest; the count is logged as gradtrack/dropped",
                    stacklevel=3,
                )

    def add_tags(self, tags: list[Tag], item: int) -> None:
        """Tags of their own (an alert's): merged into the last entry when that holds only
        tags not yet sent, so a burst of alerts is one request."""
        last = self.steps[-1] if self.steps else None
        if last is not None and not last.metrics and last.sent == 0:
            last.tags = list({**dict(last.tags), **dict(tags)}.items())
        else:
            self.steps.append(PendingStep([], tags, item))

    def add_upload(self, path: Path, artifact_dir: str, item: int | None) -> None:
        """Upload ``path`` (once, however often it changes before it goes out)."""
        for i, queued in enumerate(self.uploads):
            if (queued.path, queued.artifact_dir) == (path, artifact_dir):
                if queued.item is None:
                    self.uploads[i] = queued._replace(item=item)
                return
        self.uploads.append(Upload(path, artifact_dir, item))

    def waiting_items(self) -> list[int]:
        """The first item of every entry still owed (the oldest step's only: steps go in order)."""
        waiting = [upload.item for upload in self.uploads if upload.item is not None]
        if self.steps:
            waiting.append(self.steps[0].item)
        return waiting

    def full_request(self) -> bool:
        """Enough unsent metrics wait to fill a request."""
        unsent = 0
        for step in self.steps:
            unsent += len(step.metrics) - step.sent
            if unsent >= MAX_METRICS_PER_BATCH:
                return True
        return False

    def next_request(self) -> tuple[list[Metric], list[Tag], Plan]:
        """Metrics and tags of the oldest steps, within MLflow's per-request limits; the plan
        says how many metrics of which step go out and whether that finishes the step."""
        metrics: list[Metric] = []
        tags: list[Tag] = []
        plan: Plan = []
        for step in self.steps:
            step_tags = step.tags if step.sent == 0 else []  # tags go with a step's first part
            room = MAX_ITEMS_PER_BATCH - len(metrics) - len(tags) - len(step_tags)
            if plan and (len(tags) + len(step_tags) > MAX_TAGS_PER_BATCH or room <= 0):
                break
            take = step.metrics[step.sent : step.sent + min(room, MAX_METRICS_PER_BATCH)]
            metrics.extend(take)
            tags.extend(step_tags)
            done = step.sent + len(take) == len(step.metrics)
            plan.append((step, len(take), done))
            if not done:
                break
        return metrics, tags, plan

    def sent(self, plan: Plan) -> None:
        """The request ``plan`` made went out."""
        for step, sent_metrics, done in plan:
            step.sent += sent_metrics
            if done:
                self.steps.popleft()

    def head(self) -> str:
        """What `drop_head` drops, in words."""
        if self.steps:
            metrics = self.steps[0].metrics
            return f"the metrics of step {metrics[0][3]}" if metrics else "a batch of alert tags"
        return f"the file {self.uploads[0].path.name}" if self.uploads else "nothing"

    def drop_head(self) -> None:
        if self.steps:
            self.steps.popleft()
            self.dropped += 1
        elif self.uploads:
            self.uploads.popleft()
