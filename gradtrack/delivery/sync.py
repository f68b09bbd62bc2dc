"""``gradtrack sync``: deliver what a run left in its spool, each item once, to its tracker.

A run leaves items behind when its tracker was away at close or the process died (killed,
out of memory, no `close()` within ``flush_timeout_s``). Sync reads the spool's record of
each sink's run, resumes from that sink's cursor, and deletes the spool once every sink has
confirmed everything. Items a tracker had already taken just before a crash (the batch in
flight when the process died) are sent again; MLflow keeps one copy of an identical metric,
and gradtrack's readers drop repeated alert lines. Histograms a crashed run had not yet
written into a file are rebuilt from the spool's records (their cursor is their own).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradtrack.config.models import redact
from gradtrack.delivery.courier import SpooledCourier, wait_while_progressing
from gradtrack.delivery.spool import Spool, SpoolError, is_spool
from gradtrack.errors import GradtrackError
from gradtrack.sinks.base import TrackerSink

# How a run that never said how it ended (its process died) is marked: MLflow's status for
# a run that was stopped from outside.
UNKNOWN_OUTCOME = "KILLED"


@dataclass
class SyncResult:
    path: Path
    delivered: dict[str, int]  # sink id → items delivered now
    left: int  # items some sink still has not confirmed (0: the spool was removed)
    runs: dict[str, str]  # sink id → where its items went, in words


def spools_under(path: Path) -> Iterator[Path]:
    """``path`` itself if it is a spool, else the spools inside it (oldest first)."""
    if is_spool(path):
        yield path
        return
    if not path.is_dir():
        raise GradtrackError(f"{path} is neither a gradtrack spool nor a folder of spools")
    yield from sorted(p for p in path.iterdir() if is_spool(p))


def resume_sink(target: dict[str, Any], outcome: str, timeout_s: float) -> TrackerSink:
    """The sink that reaches the run a spool's items were meant for."""
    backend = target.get("backend")
    if backend == "mlflow":
        from gradtrack.sinks.mlflow import from_spool_target

        return from_spool_target(target, outcome, flush_timeout_s=timeout_s)
    raise GradtrackError(f"gradtrack sync cannot deliver to backend {backend!r}; it knows: mlflow")


def sync(path: Path, timeout_s: float = 300.0, say: Callable[[str], None] = print) -> SyncResult:
    """Deliver every item of the spool at ``path`` its sinks have not confirmed, for as long
    as delivery makes progress (``timeout_s``: how long it may make none)."""
    try:
        spool = Spool(path, max_bytes=1 << 62)
        meta = spool.meta()
    except SpoolError as exc:
        raise GradtrackError(str(exc)) from None
    outcome = meta.get("outcome") or UNKNOWN_OUTCOME
    delivered: dict[str, int] = {}
    runs: dict[str, str] = {}
    try:
        for sink_id, target in meta["sinks"].items():
            if _behind(spool, sink_id) == 0:
                continue
            sink = resume_sink(target, outcome, timeout_s)
            errors: list[str] = []
            courier = SpooledCourier(sink, spool, sink_id, errors.append, start=False)
            before = courier.left
            courier.announce(spool.last_seq)
            courier.request_flush(timeout_s)
            closed = courier.request_close(outcome, timeout_s)
            threading.Thread(target=courier.run_here, daemon=True).start()
            _wait(courier, closed, timeout_s, f"delivering {sink_id}")
            if courier.broken is not None:
                raise GradtrackError(courier.broken)
            delivered[sink_id] = before - courier.left
            runs[sink_id] = _describe(spool.meta()["sinks"][sink_id])
            for message in errors:
                say(redact(message))
            say(f"{sink_id}: {delivered[sink_id]} item(s) delivered to {runs[sink_id]}")
    finally:
        left = spool.undelivered()
        spool.close()
    if left == 0:
        spool.remove()
    return SyncResult(path, delivered, left, runs)


def _wait(courier: SpooledCourier, closed: threading.Event, timeout_s: float, what: str) -> None:
    wait_while_progressing(
        closed,
        lambda: courier.left,
        timeout_s,
        what,
        busy=lambda: courier.starting,
        waiting_for=courier.describe_left,
    )


def _behind(spool: Spool, sink_id: str) -> int:
    """Items some cursor of the sink (its items, its histograms) has not passed."""
    own = [seq for name, seq in spool.cursors().items() if name.split("/")[0] == sink_id]
    return spool.last_seq - min(own, default=0)


def _describe(target: dict[str, Any]) -> str:
    return redact(
        f"{target.get('backend')} run {target.get('run_id') or '(new)'} at "
        f"{target.get('tracking_uri') or 'the default store'}"
    )
