"""Callbacks for training frameworks. Each module imports its framework only when imported:

* `gradtrack.integrations.lightning.GradtrackCallback` — Lightning (``pip install
  gradtrack[lightning]``);
* `gradtrack.integrations.transformers.GradtrackCallback` — the Hugging Face ``Trainer``
  (``pip install gradtrack[transformers]``).

Here, what both callbacks share: their options and the watcher they open and close
(`CallbackOptions`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradtrack.api import WatcherLike, open_watcher
from gradtrack.capture.probes import StepSource
from gradtrack.config import ConfigSource, GradtrackConfig, load_config
from gradtrack.formats.event import AlertEvent
from gradtrack.sinks.base import GradientSink

Backend = str | GradientSink | Sequence[str | GradientSink]


class CallbackOptions:
    """``backend``, ``config``, ``on_alert`` and keyword ``overrides`` mean what they mean in
    `gradtrack.watch`; invalid options fail when the callback is made, not mid-training."""

    def __init__(
        self,
        backend: Backend | None = None,
        config: ConfigSource = None,
        *,
        on_alert: Callable[[AlertEvent], None] | None = None,
        **overrides: Any,
    ) -> None:
        self.backend = backend
        self.config: GradtrackConfig = load_config(config, overrides)
        self.on_alert = on_alert
        self.watcher: WatcherLike | None = None
        self._overrides = overrides

    def _open(
        self,
        model: torch.nn.Module,
        default_backend: Callable[[], Backend],
        optimizer: torch.optim.Optimizer | None,
        scaler: torch.amp.GradScaler | None,
        steps: StepSource,
        first_step: int,
        config: GradtrackConfig | None = None,
    ) -> None:
        """Watch ``model`` with ``backend``, or else ``default_backend()`` (asked only where
        this process writes), around the trainer's own ``optimizer`` (update ratios, the
        learning-rate rule, skip). Steps count from the trainer's own optimizer-step count,
        so a resumed run continues its step axis. ``config``: the options as the trainer's
        own settings complete them (else the callback's)."""
        self._close()
        self.watcher = open_watcher(
            model,
            lambda: self.backend or default_backend(),
            config or self.config,
            optimizer=optimizer,
            scaler=scaler,
            on_alert=self.on_alert,
            steps=steps,
        )
        self.watcher.step = first_step

    def _close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()

    def __repr__(self) -> str:
        options = " ".join(f"{key}={value!r}" for key, value in self._overrides.items())
        return f"<{type(self).__name__}{' ' + options if options else ''}>"
