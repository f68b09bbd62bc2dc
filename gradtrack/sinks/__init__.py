"""Built-in sinks, the registry that maps ``backend=`` names to them, and the sinks a watcher
gets from what ``backend=`` names: registered names, `GradientSink` objects, or a list.

The trackers' sinks (`MlflowSink`, `WandbSink`, `TensorboardSink`) are imported on first use:
``import gradtrack`` loads none of their modules, and a watch loads only the one it names.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Union

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

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from gradtrack.sinks.mlflow import MlflowSink
    from gradtrack.sinks.tensorboard import TensorboardSink
    from gradtrack.sinks.wandb import WandbSink

# The trackers' sinks, by the name they are exported as: (module, class).
_TRACKERS = {
    "MlflowSink": ("gradtrack.sinks.mlflow", "MlflowSink"),
    "WandbSink": ("gradtrack.sinks.wandb", "WandbSink"),
    "TensorboardSink": ("gradtrack.sinks.tensorboard", "TensorboardSink"),
}


def __getattr__(name: str) -> Any:
    """`MlflowSink`, `WandbSink` and `TensorboardSink`, imported when first asked for."""
    if name not in _TRACKERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _TRACKERS[name]
    return getattr(importlib.import_module(module), attribute)


def _tracker(name: str) -> Any:
    """The factory of a tracker's sink, importing its module when a watch names it."""
    return lambda config: __getattr__(name)(config)


def is_summary_writer(backend: object) -> bool:
    """A torch or tensorboardX ``SummaryWriter`` (its module is imported if one was made)."""
    modules = ("torch.utils.tensorboard.writer", "tensorboardX.writer")
    types = [sys.modules[name].SummaryWriter for name in modules if sys.modules.get(name)]
    return any(isinstance(backend, cls) for cls in types)


register_sink("console", lambda config: ConsoleSink(interval_s=config.console.interval_s))
register_sink("memory", lambda config: MemorySink())
register_sink("wandb", _tracker("WandbSink"))
register_sink("mlflow", _tracker("MlflowSink"))
register_sink("tensorboard", _tracker("TensorboardSink"))

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
            sinks.append(__getattr__("TensorboardSink")(config, writer=item))
        elif isinstance(item, GradientSink):
            sinks.append(item)
        else:
            raise GradtrackError(
                f"backend {item!r} is neither a registered name, a GradientSink (an object "
                "with write, alert, flush and close methods) nor a TensorBoard SummaryWriter"
            )
    return sinks


# The registered names whose sinks a worker process can make again (`from_recipe`).
_MADE_APART = ("mlflow",)


def from_recipe(recipe: dict[str, Any]) -> GradientSink:
    """The sink a `SinkBase.recipe` describes, made again in a worker process."""
    backend = recipe.get("backend")
    if backend == "mlflow":
        from gradtrack.sinks.mlflow import in_worker_process

        return in_worker_process(recipe)
    known = ", ".join(_MADE_APART)
    raise GradtrackError(f"a worker process cannot make a {backend!r} sink; it knows: {known}")


def made_apart(backend: object) -> bool:
    """Whether ``backend`` names only trackers a worker process can make (`from_recipe`):
    the watch's worker will run in a child (`gradtrack.worker.process.spawn_early`)."""
    names = [backend] if isinstance(backend, str) else backend
    return isinstance(names, Sequence) and bool(names) and all(n in _MADE_APART for n in names)


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
    "from_recipe",
    "made_apart",
    "register_sink",
    "registered_sinks",
]
