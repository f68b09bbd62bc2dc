"""Built-in sinks and the registry that maps ``backend=`` names to them."""

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
from gradtrack.sinks.tensorboard import TensorboardSink
from gradtrack.sinks.wandb import WandbSink

register_sink("console", lambda config: ConsoleSink(interval_s=config.console.interval_s))
register_sink("memory", lambda config: MemorySink())
register_sink("wandb", WandbSink)
register_sink("mlflow", MlflowSink)
register_sink("tensorboard", TensorboardSink)

__all__ = [
    "ConsoleSink",
    "GradientSink",
    "MemorySink",
    "MlflowSink",
    "SinkBase",
    "TensorboardSink",
    "TrackerSink",
    "WandbSink",
    "as_sink_base",
    "create_sink",
    "register_sink",
    "registered_sinks",
]
