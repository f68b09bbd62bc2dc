"""Built-in sinks, the registry that maps ``backend=`` names to them, and the sinks a watcher
gets from what ``backend=`` names: registered names, `GradientSink` objects, or a list."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Union

from gradtrack.config import GradtrackConfig
from gradtrack.errors import GradtrackError
from gradtrack.log import report
from gradtrack.sinks.base import (
    GradientSink,
    SinkBase,
    TrackerSink,
    as_sink_base,
    create_sink,
    register_sink,
    registered_sinks,
)
from gradtrack.sinks.console import ConsoleSink
from gradtrack.sinks.memory import MemorySink
from gradtrack.sinks.mlflow import MlflowSink
from gradtrack.sinks.tensorboard import TensorboardSink, is_summary_writer
from gradtrack.sinks.wandb import WandbSink

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

register_sink("console", lambda config: ConsoleSink(interval_s=config.console.interval_s))
register_sink("memory", lambda config: MemorySink())
register_sink("wandb", WandbSink)
register_sink("mlflow", MlflowSink)
register_sink("tensorboard", TensorboardSink)

# A registered name, a sink, or a TensorBoard ``SummaryWriter`` (written through as it is).
Backend = Union[str, GradientSink, "SummaryWriter"]


def build_sinks(
    backend: Backend | Sequence[Backend], config: GradtrackConfig
) -> list[GradientSink]:
    items = [backend] if isinstance(backend, str) or not isinstance(backend, Sequence) else backend
    if not items:
        raise GradtrackError("backend is empty: give a backend name, a GradientSink, or a list")
    sinks: list[GradientSink] = []
    for item in items:
        if isinstance(item, str):
            sinks.append(create_sink(item, config))
        elif is_summary_writer(item):
            sinks.append(TensorboardSink(config, writer=item))
        elif isinstance(item, GradientSink):
            sinks.append(item)
        else:
            raise GradtrackError(
                f"backend {item!r} is neither a registered name, a GradientSink (an object "
                "with write, alert, flush and close methods) nor a TensorBoard SummaryWriter"
            )
    return sinks


def finish_in_caller_thread(sinks: Sequence[GradientSink]) -> list[str]:
    """After the sinks closed, in the thread that closes the watcher (MLflow's active run is
    per thread): each sink's `SinkBase.end_shared_run` — a run the MLflow sink shared with the
    user's own ``mlflow.*`` calls is ended there too — and its `SinkBase.report_command`.
    Returns the commands that draw each run's report."""
    commands = []
    for given in sinks:
        sink = as_sink_base(given)
        try:
            sink.end_shared_run()
            command = sink.report_command()
            if command:
                commands.append(command)
        except Exception as exc:  # watching must never crash training
            report(f"gradtrack could not finish with {type(given).__name__}: {exc!r}")
    return commands


__all__ = [
    "Backend",
    "ConsoleSink",
    "GradientSink",
    "MemorySink",
    "MlflowSink",
    "SinkBase",
    "TensorboardSink",
    "TrackerSink",
    "WandbSink",
    "as_sink_base",
    "build_sinks",
    "create_sink",
    "finish_in_caller_thread",
    "register_sink",
    "registered_sinks",
]
