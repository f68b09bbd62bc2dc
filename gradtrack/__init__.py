"""gradtrack: watch a PyTorch model's gradient flow and stream it to your experiment tracker.

>>> import torch, gradtrack
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
>>> with gradtrack.watch(model, backend="memory", log_every=1) as watcher:
...     model(torch.randn(16, 4)).pow(2).mean().backward()
>>> watcher.layer_names
('0', '2')
"""

from __future__ import annotations

from gradtrack.api import WatcherLike, unwatch, watch
from gradtrack.config import GradtrackConfig
from gradtrack.config.rules import AlertRules
from gradtrack.errors import (
    GradientAlertError,
    GradientWarning,
    GradtrackConfigError,
    GradtrackError,
)
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.histogram import Histogram
from gradtrack.formats.record import LayerStats, StepRecord
from gradtrack.sinks import GradientSink, register_sink
from gradtrack.watcher import Watcher

__version__ = "0.1.0"

__all__ = [
    "AlertEvent",
    "AlertRules",
    "GradientAlertError",
    "GradientSink",
    "GradientWarning",
    "GradtrackConfig",
    "GradtrackConfigError",
    "GradtrackError",
    "Histogram",
    "LayerStats",
    "StepRecord",
    "Watcher",
    "WatcherLike",
    "register_sink",
    "unwatch",
    "watch",
]
