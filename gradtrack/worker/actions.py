"""What an alert does once the worker has it: a warning, a log record, the user's callback.

(A "raise" rule's exception is the training thread's, see `gradtrack.capture.stepper`; "skip" acts
there too.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gradtrack.alerts import AlertEngine
from gradtrack.errors import GradientWarning
from gradtrack.formats.event import AlertEvent
from gradtrack.log import logger, report, warn

_LOG_LEVEL = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class AlertActions:
    """Each event reaches the terminal once: as a `GradientWarning` where its rule's action is
    "warn", else as a logging record at its severity; then ``on_alert`` is called with it (its
    first failure reported, none stopping the worker)."""

    def __init__(
        self, engine: AlertEngine, on_alert: Callable[[AlertEvent], None] | None = None
    ) -> None:
        self.engine = engine
        self.on_alert = on_alert
        self.callback_errors = 0

    def act(self, event: AlertEvent) -> None:
        action = self.engine.rule(event.rule, event.layer).action
        if event.severity == "info":
            action = "log"
        if action == "warn":
            warn(event.message, GradientWarning)
        elif action == "log":
            logger.log(_LOG_LEVEL[event.severity], "%s", event.message)
        if self.on_alert is not None:
            try:
                self.on_alert(event)
            except Exception as exc:
                self.callback_errors += 1
                if self.callback_errors == 1:
                    report(f"gradtrack's on_alert callback failed: {exc!r}")
