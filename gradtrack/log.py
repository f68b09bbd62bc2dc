"""gradtrack's one logger, and the line to the terminal it gets when nothing else listens.

A script that never configures `logging` still sees where its run went and when its
gradients go bad; one that does configure it gets gradtrack's records through its own handlers
(and its own levels) instead — never both.
"""

from __future__ import annotations

import logging
import sys
import warnings

from gradtrack.config.models import redact

logger = logging.getLogger("gradtrack")


class _Terminal(logging.Handler):
    """Writes to the current ``sys.stderr`` (tqdm and rich leave it usable), only while the
    root logger has no handler of its own."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # the user's logging setup shows it (propagation is left on)
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


def show_in_terminal() -> None:
    """With `logging` unconfigured, let gradtrack's INFO lines reach the terminal.

    Called by `gradtrack.watch`, not at import, so that importing gradtrack changes nothing.
    A level the user set on the ``gradtrack`` logger is kept.
    """
    if not any(isinstance(handler, _Terminal) for handler in logger.handlers):
        handler = _Terminal()
        handler.setFormatter(logging.Formatter("[gradtrack] %(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET and not logging.getLogger().handlers:
        logger.setLevel(logging.INFO)


def warn(message: str, category: type[Warning] = RuntimeWarning, stacklevel: int = 2) -> None:
    """`warnings.warn` that never raises, for what the user's own code can change (a model
    compiled after watch, an optimizer stepped late): gradtrack warns from the training
    thread and its own threads, where a warning filter set to "error" must not stop training
    or delivery. A fault of gradtrack's or of a tracker is `report`'s."""
    try:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
    except Exception:
        pass


def report(message: str) -> None:
    """Tell a fault in gradtrack itself once, never raising: a WARNING of the ``gradtrack``
    logger (the terminal's ``[gradtrack]`` line, or the user's own logging). Not also a
    Python warning — nothing in the user's code can change a tracker that is down or a
    worker that stopped, and the same text twice on the terminal is noise. A sink's error
    may quote its tracker's URI, so credentials are redacted here, for every caller."""
    logger.warning(redact(message))
