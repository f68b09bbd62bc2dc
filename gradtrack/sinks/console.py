"""A human-readable table of per-layer gradient flow, rate-limited so it never floods a terminal.

The first step, the first non-finite step and the last step are always shown.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TextIO

from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord
from gradtrack.sinks.base import SinkBase


def format_table(record: StepRecord) -> str:
    """The step as a table: layer, size, L2 norm, max |g|, mean |g|, NaN and Inf counts.

    Max and mean |g| read "-" on steps that did not compute them (see ``layer_every``).
    """
    width = max([5, *(len(name) for name in record.layers)])
    extremes = record.extreme_layers()
    flow = ""
    if extremes is not None:
        (weak, low), (strong, high) = extremes
        flow = f"; weakest {weak} ({low:.2e}), strongest {strong} ({high:.2e})"
    lines = [
        f"gradtrack step {record.step}: total gradient norm {record.total_norm:.3e}{flow}",
        f"  {'layer':<{width}}  {'numel':>10}  {'norm':>10}  {'max|g|':>10}  {'mean|g|':>10}"
        f"  {'NaN':>6}  {'Inf':>6}",
    ]
    for name, stats in record.layer_stats().items():
        flag = "  <- non-finite" if stats.nan or stats.inf else ""
        max_abs, mean_abs = (
            (f"{stats.max_abs:>10.3e}", f"{stats.mean_abs:>10.3e}")
            if record.abs_stats
            else (f"{'-':>10}", f"{'-':>10}")
        )
        lines.append(
            f"  {name:<{width}}  {stats.numel:>10}  {stats.norm:>10.3e}  {max_abs}"
            f"  {mean_abs}  {stats.nan:>6}  {stats.inf:>6}{flag}"
        )
    return "\n".join(lines)


class ConsoleSink(SinkBase):
    """Prints the latest step at most every ``interval_s`` seconds."""

    def __init__(self, interval_s: float = 5.0, stream: TextIO | None = None) -> None:
        self.interval_s = interval_s
        self.stream = stream
        self._last_print = -float("inf")
        self._latest: StepRecord | None = None
        self._printed_latest = False
        self._shown_nonfinite = False

    def write(self, batch: Sequence[StepRecord]) -> None:
        for record in batch:
            if record.window_only:  # a flight window only: no step to print
                continue
            self._latest, self._printed_latest = record, False
            first_bad = (record.nan_count or record.inf_count) and not self._shown_nonfinite
            if first_bad or time.monotonic() - self._last_print >= self.interval_s:
                self._print(record)
                self._shown_nonfinite |= bool(first_bad)

    def _print(self, record: StepRecord) -> None:
        _write(format_table(record), self.stream or sys.stdout)
        self._last_print = time.monotonic()
        self._printed_latest = record is self._latest

    def alert(self, event: AlertEvent) -> None:
        """Only with a ``stream`` of its own: otherwise every alert already reaches the
        terminal once, as a `logging` record or a warning (see the rule's ``action``)."""
        if self.stream is not None:
            _write(
                f"gradtrack {event.severity.upper()} at step {event.step}: {event.message}",
                self.stream,
            )

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self._latest is not None and not self._printed_latest:
            self._print(self._latest)


def _write(text: str, stream: TextIO) -> None:
    """Print ``text`` on lines of its own: through ``tqdm.write`` while tqdm is in use (it
    clears and redraws its bars around the text, where a plain print would land in the middle
    of a bar's line)."""
    tqdm = sys.modules.get("tqdm")
    if tqdm is not None:
        tqdm.tqdm.write(text, file=stream)
        stream.flush()
    else:
        print(text, file=stream, flush=True)
