"""The W&B sink's exit hook: at interpreter exit, before W&B tears down its service, close
the watchers still open and give the steps still waiting for a user row rows of their own.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable

from gradtrack import lifecycle

_exiting = False  # set by our exit hook: the user's code has ended, nobody logs any more
# Sinks closed while the user's run goes on, holding steps that found no row of the user's:
# they get rows of their own (this callback of theirs) when that run finishes or the
# interpreter exits.
AWAITING_RUN_END: set[Callable[[], None]] = set()


def exiting() -> bool:
    """Our exit hook has run: the user's code has ended, nobody logs any more."""
    return _exiting


def _close_watchers_before_wandb_exits() -> None:
    global _exiting
    _exiting = True
    lifecycle.close_open_watchers()
    for on_run_end in list(AWAITING_RUN_END):
        on_run_end()


def order_exit_hook() -> None:
    """(Re-)register our exit hook so it runs before every W&B hook registered so far.

    atexit runs hooks last-registered first; W&B registers the teardown of its service
    process when the first run starts, and anything logged after that teardown is lost
    (MailboxClosedError). Moving our hook to the end of the list puts it first.
    """
    atexit.unregister(_close_watchers_before_wandb_exits)
    atexit.register(_close_watchers_before_wandb_exits)


_reorders_at_shutdown = False


def register_exit_hooks() -> None:
    """Order our exit hook now, and once more when the interpreter starts shutting down.

    A run started after the last sink call (``gradtrack.watch`` first, ``wandb.init`` later,
    a loop shorter than the first hand-off) registers W&B's hooks after ours. The threading
    module calls its own exit hooks before any atexit hook (``concurrent.futures`` relies
    on it), so reordering from there puts ours first whatever started when.
    """
    global _reorders_at_shutdown
    order_exit_hook()
    register = getattr(threading, "_register_atexit", None)
    if register is None or _reorders_at_shutdown:
        return
    try:
        register(order_exit_hook)
        _reorders_at_shutdown = True
    except RuntimeError:  # already shutting down: the atexit order is what it is
        pass
