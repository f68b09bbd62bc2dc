"""The optimizers training frameworks hand out, seen through to the one that steps.

Accelerate's ``AcceleratedOptimizer`` (what ``accelerator.prepare`` and the Hugging Face
Trainer return) is called at every micro-batch and steps its inner optimizer only where
``sync_gradients`` says so: gradtrack hooks the inner one, so a step is one real optimizer
step. A DeepSpeed engine steps its own optimizer (`gradtrack.capture.zero`). A framework is
looked at only if the user has imported it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from gradtrack.capture.zero import PartitionGrads, is_engine, steppable, zero_optimizer, zero_stage
from gradtrack.errors import GradtrackError


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside Accelerate's wrapper (others: itself).

    >>> sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    >>> unwrap_optimizer(sgd) is sgd
    True
    """
    if "accelerate" in sys.modules:
        from accelerate.optimizer import AcceleratedOptimizer

        while isinstance(optimizer, AcceleratedOptimizer):
            optimizer = optimizer.optimizer
    return optimizer


def scaler_of(optimizer: Any) -> torch.amp.GradScaler | None:
    """The enabled GradScaler an ``AcceleratedOptimizer`` steps through (fp16 mixed
    precision), if any."""
    scaler = getattr(optimizer, "scaler", None)
    if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled():
        return scaler
    return None


def hooked_optimizer(
    model: nn.Module, params: list[nn.Parameter], optimizer: Any
) -> tuple[Any, PartitionGrads | None]:
    """The optimizer whose step is a gradtrack step, as gradtrack hooks it (see
    `gradtrack.capture.zero.steppable`), and under DeepSpeed ZeRO 1–3 the partitions the
    gradients live in. A DeepSpeed engine watched without ``optimizer=`` gives its own: one
    step per step of it, as DeepSpeed counts them."""
    if optimizer is None and is_engine(model):
        optimizer = model
    partitions = None
    stage = zero_stage(params)
    if stage:
        if optimizer is None:
            optimizer = zero_optimizer(params)  # ZeRO-3's parameters link to it
        if optimizer is None:
            raise GradtrackError(
                "under DeepSpeed ZeRO stages 1 and 2 gradtrack needs the engine, which "
                "steps the partitions the gradients live in: gradtrack.watch(engine, ...) "
                "or gradtrack.watch(engine.module, optimizer=engine)"
            )
        owner = optimizer.optimizer if is_engine(optimizer) else optimizer
        partitions = PartitionGrads(params, owner, stage)
    return steppable(unwrap_optimizer(optimizer)), partitions
