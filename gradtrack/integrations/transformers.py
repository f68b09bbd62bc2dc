"""Hugging Face: ``Trainer(..., callbacks=[GradtrackCallback()])`` watches the model.

>>> from gradtrack.integrations.transformers import GradtrackCallback
>>> GradtrackCallback(log_every=50)
<GradtrackCallback log_every=50>

One record per optimizer step, numbered as the Trainer numbers it: the step that the
Trainer then logs as ``global_step`` k (its loss, its ``grad_norm``) is gradtrack's step k, so
both line up in the tracker. The record is taken at the end of the backward pass
that completes it (the last micro-batch of gradient accumulation): the gradients the model
produced, *before* the Trainer clips them (it clips at ``max_grad_norm=1.0`` by default, and a
clipped gradient never looks like it exploded). The Trainer's optimizer is watched too (update
ratios, the learning-rate rule, ``action="skip"``): the one inside Accelerate's wrapper, which
steps once per Trainer step. With ``deepspeed=`` the record is taken at DeepSpeed's optimizer
step (before it clips), of the gradient that step applies (ZeRO's partitions included). Under
fp16 mixed precision with a GradScaler the record is taken at ``scaler.update()`` instead,
where gradients are unscaled — and clipped.
Layer names are the model's module names (``transformer.h.0.attn.c_attn``). Without
``backend`` the sinks follow ``TrainingArguments.report_to``: ``"wandb"`` → the Trainer's W&B
run, ``"mlflow"`` → its MLflow run, ``"tensorboard"`` → the Trainer's TensorBoard log dir
(``TENSORBOARD_LOGGING_DIR``, else the newest ``<output_dir>/runs/<date>_<host>`` its
TensorBoard callback opened), otherwise the console.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gradtrack.capture.probes import scaler_of
from gradtrack.config import GradtrackConfig
from gradtrack.errors import GradtrackError
from gradtrack.integrations import CallbackOptions
from gradtrack.sinks.base import GradientSink

if importlib.util.find_spec("transformers") is None:
    raise GradtrackError(
        "gradtrack.integrations.transformers needs transformers: "
        "pip install gradtrack[transformers]"
    )
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments


class GradtrackCallback(CallbackOptions, TrainerCallback):
    """Watch the Trainer's model from ``on_train_begin`` to ``on_train_end``.

    ``backend``, ``config``, ``on_alert`` and keyword ``overrides`` mean what they mean in
    `gradtrack.watch`. The watcher is ``self.watcher`` while training runs.
    """

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        if model is None:
            raise GradtrackError("the Trainer gave GradtrackCallback no model")
        scaler = scaler_of(optimizer)
        deepspeed = getattr(args, "deepspeed_plugin", None) is not None
        self._open(
            model,
            default_backend=lambda: _sinks_of(args, self.config),
            optimizer=optimizer,  # (the watcher hooks the one inside Accelerate's wrapper)
            scaler=scaler,
            # A GradScaler's update, or DeepSpeed's step (its engine reduces the gradients
            # after backward: they are complete only when its optimizer steps).
            steps="auto" if scaler is not None or deepspeed else _last_micro_batch(),
            # The Trainer counts a step once its optimizer has stepped (global_step 1 is the
            # first update) and logs it under that number; gradtrack's step ends before it.
            first_step=state.global_step + 1,
        )

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._close()


def _last_micro_batch() -> Callable[[], bool]:
    """True during the backward of a micro-batch after which the Trainer steps: it sets
    accelerate's shared gradient state before each micro-batch."""
    from accelerate.state import GradientState

    gradient_state = GradientState()
    return lambda: bool(gradient_state.sync_gradients)


def _sinks_of(args: TrainingArguments, config: GradtrackConfig) -> list[str | GradientSink]:
    report_to = args.report_to or []
    report_to = [report_to] if isinstance(report_to, str) else list(report_to)
    reported = [name for name in ("wandb", "mlflow", "tensorboard") if name in report_to]
    if "all" in report_to:
        reported = ["wandb", "mlflow", "tensorboard"]
    # The Trainer's own W&B/MLflow callbacks run first and leave their run active; its
    # TensorBoard callback has opened its writer's log dir.
    sinks: list[str | GradientSink] = [name for name in reported if name != "tensorboard"]
    if "tensorboard" in reported:
        from gradtrack.sinks.tensorboard import TensorboardSink

        options = config.tensorboard.model_copy(update={"log_dir": str(trainer_log_dir(args))})
        sinks.append(TensorboardSink(config.model_copy(update={"tensorboard": options})))
    return sinks or ["console"]


def trainer_log_dir(args: TrainingArguments) -> Path:
    """The folder the Trainer's TensorBoard callback writes to: ``TENSORBOARD_LOGGING_DIR``,
    an older Trainer's ``logging_dir``, else the newest ``<output_dir>/runs/*`` holding event
    files (the callback names it by the time it opened it)."""
    named = os.getenv("TENSORBOARD_LOGGING_DIR") or getattr(args, "logging_dir", None)
    if named:
        return Path(os.path.expanduser(named))
    runs = [p.parent for p in Path(args.output_dir or ".", "runs").glob("*/*tfevents*")]
    if not runs:
        raise GradtrackError(
            f"report_to='tensorboard', but no TensorBoard log dir under {args.output_dir}/runs: "
            "add GradtrackCallback after the Trainer's callbacks, or pass backend="
        )
    return max(runs, key=lambda p: p.stat().st_mtime)
