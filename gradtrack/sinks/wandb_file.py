"""Every step the W&B sink is handed, appended to step files the run carries, as training goes.

The files sit in the run's own folder (``run.dir``) and are saved with ``run.save(...,
policy="live")``: W&B uploads each as it grows (an offline run keeps them for ``wandb sync``).
A file is closed once it passes ``PART_BYTES`` and the next one started, so a live upload never
re-sends more than that. Format and reader: `gradtrack.formats.wandb_steps`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

from gradtrack.formats.wandb_steps import part_name, steps_dir

if TYPE_CHECKING:
    from wandb import Run

PART_BYTES = 1 << 20  # a part this large is closed; the next line starts a new one


class StepFiles:
    """Appends step lines to the run's current part, starting (and saving) a new one as due."""

    def __init__(self, model_name: str | None) -> None:
        self._folder = steps_dir(model_name)
        self._file: IO[str] | None = None
        self._written = 0  # bytes in the current part
        self.steps = 0  # lines written, all parts

    def append(self, run: Run, lines: Sequence[tuple[int, str]]) -> None:
        """Write ``(step, line)`` pairs, oldest first, flushed to the operating system."""
        for step, line in lines:
            if self._file is None or self._written >= PART_BYTES:
                self._start(run, step)
            assert self._file is not None
            self._file.write(line)
            self._written += len(line)
            self.steps += 1
        if self._file is not None:
            self._file.flush()  # what W&B's live upload reads, and a reader of the run dir

    def _start(self, run: Run, first_step: int) -> None:
        self.close()
        root = Path(run.dir)
        path = root / self._folder / part_name(first_step)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self._written = path.stat().st_size
        # Already in the run's folder: W&B only records the policy (no copy, no link).
        run.save(str(path), base_path=str(root), policy="live")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
