"""Waiting for delivery at close and in ``gradtrack sync``: as long as it makes progress, with
a progress line every few seconds, and not past ``patience_s`` without any."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gradtrack.log import logger

_LINE_EVERY_S = 5.0


def wait_while_progressing(
    done: threading.Event,
    left: Callable[[], int],
    patience_s: float,
    what: str,
    busy: Callable[[], bool] = lambda: False,
    line_every_s: float | None = None,
    waiting_for: Callable[[], str] | None = None,
) -> bool:
    """Wait for ``done``; True once set. False once ``left()`` (items still to deliver) has
    not gone down for ``patience_s`` while not ``busy()`` (a first connection under way: an
    SDK's import, a store's creation). While waiting longer than ``line_every_s`` (5 s), logs
    ``what``'s progress every ``line_every_s``: what it waits for (``waiting_for()``: the
    kinds of item left and their counts, or the sink's own last step), rate, time to go."""
    every_s = _LINE_EVERY_S if line_every_s is None else line_every_s
    start = last_line = time.monotonic()
    fewest = first = _safe(left)
    progress_at = start
    while not done.wait(min(0.25, patience_s)):
        now = time.monotonic()
        count = _safe(left)
        if count < fewest or _safe(busy):
            fewest, progress_at = min(count, fewest), now
        if now - progress_at > patience_s:
            return done.is_set()
        if now - last_line >= every_s:
            last_line = now
            detail = _safe_text(waiting_for) if waiting_for is not None else None
            line = progress_line(what, count, first - count, now - start, detail)
            logger.info("%s", line)
    return True


def progress_line(
    what: str, left: int, delivered: int, elapsed_s: float, detail: str | None = None
) -> str:
    """``delivering to MLflow: 2,340 item(s) left, 850/s, about 3 s to go``; ``detail``
    says what is left instead of the bare count (and, with nothing left, what is waited for).

    >>> progress_line("delivering to MLflow", 2340, 8500, 10.0)
    'delivering to MLflow: 2,340 item(s) left, 850/s, about 3 s to go'
    >>> progress_line("delivering to MLflow", 10, 0, 10.0)
    'delivering to MLflow: 10 item(s) left, none delivered for 10 s'
    >>> progress_line("delivering to MLflow", 0, 4000, 20.0, "ending its run")
    'delivering to MLflow: every item delivered, ending its run, for 20 s'
    """
    if left == 0:
        waited = detail or "the sinks finishing"
        return f"{what}: every item delivered, {waited}, for {elapsed_s:.0f} s"
    told = detail or f"{left:,} item(s)"
    rate = delivered / elapsed_s if elapsed_s > 0 else 0.0
    if rate <= 0:
        return f"{what}: {told} left, none delivered for {elapsed_s:.0f} s"
    return f"{what}: {told} left, {rate:,.0f}/s, about {max(1.0, left / rate):,.0f} s to go"


def _safe_text(read: Callable[[], str]) -> str | None:
    try:
        return read() or None
    except Exception:  # a closed spool: the count alone
        return None


def _safe(read: Callable[[], int]) -> int:
    try:
        return int(read())
    except Exception:  # a closed spool: nothing more to count
        return 0
