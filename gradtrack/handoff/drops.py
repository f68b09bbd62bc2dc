"""Counting steps lost between the training thread and the trackers: never silent."""

from __future__ import annotations

import threading
from collections.abc import Callable


class DropCount:
    """Steps lost anywhere between the training thread and the sinks, counted once; the
    first loss is reported (``on_first``), every later one only counted."""

    def __init__(self, on_first: Callable[[str], None]) -> None:
        self.total = 0
        self._on_first = on_first
        self._lock = threading.Lock()

    def add(self, n: int, why: str) -> None:
        with self._lock:
            first = self.total == 0
            self.total += n
        if first:
            self._on_first(
                f"gradtrack dropped {n} step(s): {why}; further losses are counted in "
                "watcher.dropped_steps and logged as gradtrack/dropped"
            )
