"""The watcher `gradtrack.watch` returns when gradtrack is switched off.

``GRADTRACK_DISABLED=1`` (or ``enabled=False``) lets a script keep its ``watch`` line in
production: the model gets no hook, no sink is made, no thread starts, nothing is written.
"""

from __future__ import annotations

import weakref

from torch import nn

from gradtrack.config import GradtrackConfig
from gradtrack.lifecycle import Outcome
from gradtrack.sinks.base import GradientSink
from gradtrack.watcher import Watcher


class DisabledWatcher(Watcher):
    """A `Watcher` that watches nothing: every method works and does nothing.

    It skips `Watcher.__init__` on purpose (that is where hooks, sinks and the worker thread
    are made) and answers the public state as an idle watcher would.

    >>> import torch
    >>> watcher = DisabledWatcher(torch.nn.Linear(2, 1), GradtrackConfig(enabled=False))
    >>> watcher.layer_names, watcher.sinks, watcher.flush()
    ((), [], True)
    >>> watcher.close(); watcher
    <gradtrack.Watcher off (enabled=False), closed>
    """

    def __init__(self, model: nn.Module, config: GradtrackConfig) -> None:
        self.model_ref = weakref.ref(model)
        self.config = config
        self._step = 0
        self.closed = False

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value

    @property
    def layer_names(self) -> tuple[str, ...]:
        return ()

    @property
    def sinks(self) -> list[GradientSink]:
        return []

    @property
    def dropped_steps(self) -> int:
        return 0

    @property
    def host_transfers(self) -> int:
        return 0

    @property
    def sink_errors(self) -> dict[str, int]:
        return {}

    def end_step(self) -> None:
        self.step += 1

    def flush(self, timeout_s: float | None = None) -> bool:
        return True

    def close(self, outcome: Outcome = "FINISHED") -> None:
        self.closed = True

    def __repr__(self) -> str:
        return f"<gradtrack.Watcher off (enabled=False){', closed' if self.closed else ''}>"
