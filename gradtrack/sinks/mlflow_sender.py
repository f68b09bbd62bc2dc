"""Sends the MLflow sink's outbox to its run, and rides out a server that is away.

A failed request stays at the head of the outbox and is retried with backoff (doubling from
0.5 s up to ``retry_max_s``); the outage is warned about once, when it starts. A refusal
(401/403, an untrusted TLS certificate) is not fixed by waiting: the sink does not wait for
it at close. A request MLflow refuses for what it holds is dropped, with a warning.
"""

from __future__ import annotations

import math
import time

from gradtrack.config import MlflowOptions
from gradtrack.log import warn
from gradtrack.redact import redact
from gradtrack.sinks.mlflow_auth import refusal_message
from gradtrack.sinks.mlflow_outbox import Outbox
from gradtrack.sinks.mlflow_run import MlflowRun
from gradtrack.sinks.mlflow_tracking import PermanentError, Refusal

# An alert goes out at once unless something was sent less than this long ago; then it
# waits for the next write after that (a burst of alerts — several rules tripping at one
# step, or a step per batch — becomes one request instead of one each).
_ALERT_WAIT_S = 1.0


class Sender:
    """When to send, and sending: the outbox's entries in order, with backoff on failure."""

    def __init__(self, options: MlflowOptions, run: MlflowRun, outbox: Outbox) -> None:
        self.options, self.run, self.outbox = options, run, outbox
        self.failures = 0
        self.alert_waiting = False
        # The last request was refused (401/403, untrusted TLS): waiting fixes nothing.
        self.refused = False
        self._retry_at = 0.0
        self._backoff_s = 0.0
        self._last_sent = -math.inf  # the first write goes out at once: the run appears
        self._outage_reported = False

    def due(self) -> bool:
        """``send_every_s`` has passed since the last send (an alert waits at most
        ``_ALERT_WAIT_S``), or a full request is waiting."""
        since = time.monotonic() - self._last_sent
        if since >= self.options.send_every_s or (self.alert_waiting and since >= _ALERT_WAIT_S):
            return True
        return self.outbox.full_request()

    def retry_now(self) -> None:
        """Let the next `pump` try at once, backoff or not."""
        self._retry_at = min(self._retry_at, time.monotonic())

    def pump(self, until: float | None) -> None:
        """Send what is buffered; on failure back off, and wait it out only until ``until``."""
        self.alert_waiting = False
        outbox = self.outbox
        try:
            while outbox.steps or outbox.uploads:
                wait = self._retry_at - time.monotonic()
                if wait > 0:
                    if until is None or time.monotonic() + wait > until:
                        return
                    time.sleep(wait)
                try:
                    self._send_next()
                except PermanentError as exc:
                    warn(redact(f"MLflow refused {outbox.head()} from gradtrack, dropped: {exc}"))
                    outbox.drop_head()
                except Exception as exc:  # unreachable, timed out, 5xx: keep it and retry
                    self._fail(exc)
                else:
                    self._recovered()
        finally:
            self._last_sent = time.monotonic()

    def _send_next(self) -> None:
        tracking = self.run.connection()
        run_id = self.run.started()
        if self.outbox.steps:
            metrics, tags, plan = self.outbox.next_request()
            tracking.log_batch(run_id, metrics, tags)
            self.outbox.sent(plan)
            return
        path, artifact_dir, _ = self.outbox.uploads[0]
        if self.run.artifact_uri is None:
            self.run.artifact_uri = tracking.artifact_uri(run_id)
        tracking.log_artifact(run_id, self.run.artifact_uri, path, artifact_dir)
        self.outbox.uploads.popleft()

    def _fail(self, error: Exception) -> None:
        self.failures += 1
        self._backoff_s = min(self.options.retry_max_s, max(0.5, self._backoff_s * 2))
        self._retry_at = time.monotonic() + self._backoff_s
        self.refused = isinstance(error, Refusal)
        if self._outage_reported:
            return
        self._outage_reported = True
        uri = self.run.tracking_uri
        if isinstance(error, Refusal):
            warn(redact(refusal_message(error, uri, self.run.experiment())))
        else:
            warn(
                redact(
                    f"gradtrack cannot reach MLflow at {uri} ({error!r}); steps "
                    "wait (in the run's spool) and are retried with backoff"
                )
            )

    def _recovered(self) -> None:
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self._outage_reported = False
        self.refused = False
