"""Lightning: ``Trainer(callbacks=[GradtrackCallback()])`` watches the LightningModule.

>>> from gradtrack.integrations.lightning import GradtrackCallback
>>> GradtrackCallback(log_every=50)
<GradtrackCallback log_every=50>

One record per optimizer step, taken in ``on_before_optimizer_step``: after gradient
accumulation, after a mixed-precision GradScaler has unscaled the gradients, before clipping
(the gradients the model produced, as Lightning's own gradient-norm logging sees them). The
trainer's optimizer is watched too (update ratios, the learning-rate rule, ``action="skip"``).
Steps are numbered and logged as Lightning numbers and logs them: step ``s`` is Lightning's
``global_step`` ``s`` and is summarised where Lightning logs, ``(s + 1) %
log_every_n_steps == 0`` (``log_every``, if given, in place of ``log_every_n_steps``).
Without ``backend`` the sinks follow the trainer's loggers: a ``WandbLogger`` → its W&B run,
an ``MLFlowLogger`` → its MLflow run, a ``TensorBoardLogger`` → its ``SummaryWriter`` (its
version's log dir), otherwise the console.
"""

from __future__ import annotations

import importlib.util

import torch
from pydantic import SecretStr

from gradtrack.config import GradtrackConfig
from gradtrack.errors import GradtrackError
from gradtrack.integrations import CallbackOptions
from gradtrack.sinks.base import GradientSink

if importlib.util.find_spec("lightning") is not None:
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger
elif importlib.util.find_spec("pytorch_lightning") is not None:
    from pytorch_lightning import Callback, LightningModule, Trainer  # type: ignore[assignment]
    from pytorch_lightning.loggers import (  # type: ignore[assignment]
        MLFlowLogger,
        TensorBoardLogger,
        WandbLogger,
    )
else:
    raise GradtrackError(
        "gradtrack.integrations.lightning needs Lightning: pip install gradtrack[lightning]"
    )


class GradtrackCallback(CallbackOptions, Callback):
    """Watch the LightningModule's gradients while ``trainer.fit`` trains.

    ``backend``, ``config``, ``on_alert`` and keyword ``overrides`` mean what they mean in
    `gradtrack.watch`. The watcher is ``self.watcher`` from ``on_train_start`` (steps continue
    a resumed run's ``global_step``) until training ends.
    """

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After a checkpoint's state is restored: global_step is the resumed one.
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        optimizers = trainer.optimizers
        # (Set by its logger connector, not declared on Trainer.)
        config = lightning_cadence(self.config, int(getattr(trainer, "log_every_n_steps", 0)))
        self._open(
            pl_module,
            default_backend=lambda: _sinks_of(trainer, config),
            # Several optimizers step in turn within one Lightning step: none is the step's.
            optimizer=optimizers[0] if len(optimizers) == 1 else None,
            scaler=scaler if isinstance(scaler, torch.amp.GradScaler) else None,
            steps="manual",
            first_step=trainer.global_step,
            config=config,
        )

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.watcher is not None:
            self.watcher.end_step()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close()

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._close()


def lightning_cadence(config: GradtrackConfig, log_every_n_steps: int) -> GradtrackConfig:
    """``config`` logging the steps Lightning logs: every ``log_every_n_steps``-th unless
    ``log_every`` was given, counted as Lightning counts (``(step + 1) % N == 0``).

    >>> config = lightning_cadence(GradtrackConfig(), log_every_n_steps=50)
    >>> config.log_every, config.log_offset
    (50, 1)
    >>> lightning_cadence(GradtrackConfig(log_every=5), log_every_n_steps=50).log_every
    5
    """
    update: dict[str, int] = {"log_offset": 1}
    if "log_every" not in config.model_fields_set and log_every_n_steps > 0:
        update["log_every"] = log_every_n_steps
    return config.model_copy(update=update)


def _sinks_of(trainer: Trainer, config: GradtrackConfig) -> list[str | GradientSink]:
    """A sink on each tracker run the trainer's loggers already write to; else the console."""
    sinks: list[str | GradientSink] = []
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            from gradtrack.sinks.wandb import WandbSink

            sinks.append(WandbSink(config, run=logger.experiment))
        elif isinstance(logger, MLFlowLogger):
            from gradtrack.sinks.mlflow import MlflowSink

            uri = logger.experiment.tracking_uri  # an MlflowClient
            options = config.mlflow.model_copy(update={"tracking_uri": SecretStr(uri)})
            sinks.append(MlflowSink(config.model_copy(update={"mlflow": options}), logger.run_id))
        elif isinstance(logger, TensorBoardLogger):
            from gradtrack.sinks.tensorboard import TensorboardSink

            sinks.append(TensorboardSink(config, writer=logger.experiment))
    return sinks or ["console"]
