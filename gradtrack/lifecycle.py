"""Which watchers are open, and how training ended: what closes them at interpreter exit.

gradtrack's one exit path. The watchers still open when the main thread ends are closed then,
by a thread that waits for it, before the interpreter runs any ``atexit`` hook: the trackers'
own hooks (W&B tears its service down in one, MLflow ends its active run in another) find
every step delivered, whenever their runs were started. The interpreter waits for non-daemon
threads before it runs those hooks, so this needs no hook order and no private API. Should
other non-daemon threads still run when the main thread ends (training in one of them), the
watchers are left to the ``atexit`` hook below, which runs once they have ended.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from typing import Literal, Protocol

Outcome = Literal["FINISHED", "FAILED", "KILLED"]


class Closable(Protocol):
    def close(self, outcome: Outcome = "FINISHED") -> None: ...


_OPEN: weakref.WeakSet[Closable] = weakref.WeakSet()


_exit_thread: threading.Thread | None = None
_exit_lock = threading.Lock()


def opened(watcher: Closable) -> None:
    _OPEN.add(watcher)
    _close_when_the_main_thread_ends()


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


def _close_when_the_main_thread_ends() -> None:
    """Start, once per process, the thread that closes the open watchers at exit."""
    global _exit_thread
    with _exit_lock:
        if _exit_thread is not None and _exit_thread.is_alive():
            return
        _exit_thread = threading.Thread(
            target=_after_the_main_thread, name="gradtrack-exit", daemon=False
        )
        try:
            _exit_thread.start()
        except RuntimeError:  # the interpreter is shutting down: the atexit hook closes them
            _exit_thread = None


def _after_the_main_thread() -> None:
    threading.main_thread().join()
    me = threading.current_thread()
    others = [t for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]
    if not others:
        close_open_watchers()


def _forget_the_exit_thread() -> None:
    global _exit_thread, _exit_lock
    _exit_thread = None  # a forked child has none of its parent's threads
    _exit_lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # not on Windows, which does not fork
    os.register_at_fork(after_in_child=_forget_the_exit_thread)


@atexit.register
def close_open_watchers() -> None:
    """Close every open watcher: a script that never closes its watcher still gets its last
    steps delivered. An exception the interpreter is exiting with is left in sys.last_type."""
    outcome = outcome_of(getattr(sys, "last_type", None))
    for watcher in list(_OPEN):
        watcher.close(outcome)
