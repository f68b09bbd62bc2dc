"""TensorBoard sink: the same metric keys as scalars, gradtrack's own bins as raw histograms,
alerts and the layer order as text, the pictures as images, in a log dir's event files.

Local files, like W&B's offline run: no spool, delivered by the in-memory courier. Each batch
is flushed to the event file before `write` returns, so a process that exits without
`close()` (the open watchers are closed at exit, `gradtrack.lifecycle`) loses nothing; a
write that fails (a full disk) raises once to the courier, which reports it once and goes on.
The names written are in `gradtrack.formats.tensorboard`.

torch.utils.tensorboard (which needs the ``tensorboard`` package) is imported only when the
first step is written; a ``SummaryWriter`` given is used as it is and left open at close.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradtrack.config import GradtrackConfig
from gradtrack.errors import GradtrackError, require_module
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.metrics import metric_key, scalar_metrics
from gradtrack.formats.record import StepRecord
from gradtrack.formats.tensorboard import (
    ALERTS_TAG,
    HIST_FAMILY,
    LAYERS_TAG,
    PICTURES_FAMILY,
    alert_text,
    default_log_dir,
    layers_text,
    raw_histogram,
)
from gradtrack.sinks.base import RunBook, SinkBase

# The writer threads of the SummaryWriters gradtrack made: a write error that ends one (a full
# disk) is raised again in the sink's next write, flush or close, which reports it once; the
# thread's own traceback would tell it a second time.
_WRITER_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_previous_hook = threading.excepthook


def _quiet_write_errors(threads: set[threading.Thread]) -> None:
    global _previous_hook
    _WRITER_THREADS.update(threads)
    if threading.excepthook is not _excepthook:
        _previous_hook, threading.excepthook = threading.excepthook, _excepthook


def _excepthook(args: threading.ExceptHookArgs) -> None:
    if args.thread in _WRITER_THREADS and isinstance(args.exc_value, OSError):
        return  # told by the sink, as a fault of gradtrack's delivery
    _previous_hook(args)


def is_summary_writer(backend: object) -> bool:
    """A torch or tensorboardX ``SummaryWriter`` (its module is imported if one was made)."""
    modules = ("torch.utils.tensorboard.writer", "tensorboardX.writer")
    types = [sys.modules[name].SummaryWriter for name in modules if sys.modules.get(name)]
    return any(isinstance(backend, cls) for cls in types)


class TensorboardSink(SinkBase):
    """Writes every step it is handed to a TensorBoard log dir. Called from its courier
    thread only.

    ``writer``: a ``SummaryWriter`` (torch's or tensorboardX's) to write through, e.g.
    Lightning's ``TensorBoardLogger.experiment``; else one is made on ``config.tensorboard``'s
    ``log_dir`` at the first write.
    """

    def __init__(self, config: GradtrackConfig | None = None, writer: Any = None) -> None:
        if writer is None:
            require_module("tensorboard", "tensorboard")
        self.config = config or GradtrackConfig()
        self.options = self.config.tensorboard
        self._writer = writer
        self._owns_writer = writer is None
        self._book = RunBook()
        self._last_step: int | None = None
        # The report package draws; imported here, not at the top: it sits above the sinks.
        from gradtrack.report.live import Pictures

        self._pictures = Pictures(self.options.pictures, self.options.pictures_every)

    @property
    def writer(self) -> Any:
        """The ``SummaryWriter``: the one given, else one made now on the log dir."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            before = set(threading.enumerate())
            self._writer = SummaryWriter(log_dir=str(self.options.log_dir or default_log_dir()))
            _quiet_write_errors(set(threading.enumerate()) - before)
        return self._writer

    @property
    def log_dir(self) -> Path:
        """Where the events go (torch's writer says ``log_dir``, tensorboardX's ``logdir``)."""
        return Path(getattr(self.writer, "log_dir", None) or self.writer.logdir)

    def _scalar_options(self, writer: Any) -> dict[str, bool]:
        """torch's writer stores doubles (a tensor summary): a float32 ``simple_value``
        would turn a 1e-40 gradient norm into 0 and round every other value."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboardX's writer, without the tensorboard package
            return {}
        return (
            {"new_style": True, "double_precision": True}
            if isinstance(writer, SummaryWriter)
            else {}
        )

    # -- GradientSink ----------------------------------------------------------------------
    def write(self, batch: Sequence[StepRecord]) -> None:
        writer = self.writer
        model = self.config.model_name
        options = self._scalar_options(writer)
        try:
            if self._book.add_layers(layer for record in batch for layer in record.layers):
                writer.add_text(LAYERS_TAG, layers_text(self._book.layers), batch[0].step)
            for record in batch:
                for key, value in scalar_metrics(record).items():
                    writer.add_scalar(key, value, record.step, **options)
                for layer, histogram in record.histograms.items():
                    tag = metric_key(HIST_FAMILY, layer, model)
                    writer.add_histogram_raw(
                        tag, global_step=record.step, **raw_histogram(histogram)
                    )
                self._last_step = record.step
            writer.flush()  # on disk before the courier takes the next batch
        except OSError as error:
            raise GradtrackError(
                f"cannot write TensorBoard events to {self.log_dir} ({error!r}): the disk may be "
                "full; training goes on, these steps are not in the log dir"
            ) from None
        if self._pictures.add(batch):
            self._write_pictures()

    def alert(self, event: AlertEvent) -> None:
        self._pictures.alert(event)
        self.writer.add_text(ALERTS_TAG, alert_text(event), event.step)
        self.writer.flush()

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is None:
            return
        try:
            if self._pictures.due_at_close():
                self._write_pictures()
        finally:
            if self._owns_writer:
                self._writer.close()
            else:
                self._writer.flush()

    def report_command(self) -> str | None:
        if self._writer is None:
            return None
        return f"gradtrack report {self.log_dir}"

    def _write_pictures(self) -> None:
        """The pictures as images at the last step written, ``grad_pictures/<name>``."""
        from matplotlib import image

        with tempfile.TemporaryDirectory(prefix="gradtrack-pictures-") as directory:
            source = f"TensorBoard log dir {self.log_dir}"
            paths = self._pictures.draw(Path(directory), self.log_dir.name, source)
            for path in paths:
                if path.suffix == ".png":
                    tag = metric_key(PICTURES_FAMILY, path.stem, self.config.model_name)
                    pixels = image.imread(str(path))[..., :3]
                    self.writer.add_image(tag, pixels, self._last_step, dataformats="HWC")
        self.writer.flush()
