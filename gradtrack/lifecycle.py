"""Which watchers are open, and how training ended: what closes them at interpreter exit.

Kept apart from `gradtrack.watcher` so that the sinks, whose trackers have exit hooks of their
own, can close every open watcher before theirs run without importing the watcher.
"""

from __future__ import annotations

import atexit
import sys
import weakref
from typing import Literal, Protocol

Outcome = Literal["FINISHED", "FAILED", "KILLED"]


class Closable(Protocol):
    def close(self, outcome: Outcome = "FINISHED") -> None: ...


_OPEN: weakref.WeakSet[Closable] = weakref.WeakSet()


def opened(watcher: Closable) -> None:
    _OPEN.add(watcher)


def closed(watcher: Closable) -> None:
    _OPEN.discard(watcher)


def outcome_of(error: type[BaseException] | None) -> Outcome:
    """How training ended, from the exception that ended it (None: it did not raise).

    >>> outcome_of(None), outcome_of(KeyboardInterrupt), outcome_of(ValueError)
    ('FINISHED', 'KILLED', 'FAILED')
    """
    if error is None or issubclass(error, SystemExit):
        return "FINISHED"
    return "KILLED" if issubclass(error, KeyboardInterrupt) else "FAILED"


@atexit.register
def close_open_watchers() -> None:
    """Close every open watcher: a script that never closes its watcher still gets its last
    steps delivered. An exception the interpreter is exiting with is left in sys.last_type."""
    outcome = outcome_of(getattr(sys, "last_type", None))
    for watcher in list(_OPEN):
        watcher.close(outcome)
