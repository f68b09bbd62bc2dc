"""The MLflow sink's histograms: gathered step by step, written as one chunk file per
``hist_chunk_steps`` steps (`gradtrack.formats.histogram_store`) for the sink to upload."""

from __future__ import annotations

from pathlib import Path

from gradtrack.formats.histogram_store import HistogramEntry, write_chunk
from gradtrack.record import StepRecord


class HistogramChunks:
    """Histograms not yet in a chunk file, and the first handed item among them."""

    def __init__(self, chunk_steps: int) -> None:
        self.chunk_steps = chunk_steps
        self.item: int | None = None  # the first item whose histograms wait
        self._entries: list[HistogramEntry] = []
        self._steps: set[int] = set()

    def add(self, record: StepRecord, item: int) -> bool:
        """Keep the record's histograms; True once a chunk's worth of steps waits."""
        if record.histograms and self.item is None:
            self.item = item
        for layer, histogram in record.histograms.items():
            self._entries.append((record.step, layer, histogram))
            self._steps.add(record.step)
        return len(self._steps) >= self.chunk_steps

    def write(self, directory: Path) -> tuple[Path, int | None] | None:
        """The waiting histograms as one chunk file in ``directory``, and the first item they
        hold; None when none wait."""
        if not self._entries:
            return None
        path = write_chunk(directory, self._entries)
        item, self.item = self.item, None
        self._entries, self._steps = [], set()
        return path, item
