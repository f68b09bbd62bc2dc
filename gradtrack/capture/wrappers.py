"""The optimizers training frameworks hand out, seen through to the one that steps.

Accelerate's ``AcceleratedOptimizer`` (what ``accelerator.prepare`` and the Hugging Face
Trainer return) is called at every micro-batch and steps its inner optimizer only where
``sync_gradients`` says so: gradtrack hooks the inner one, so a step is one real optimizer
step. A framework is looked at only if the user has imported it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


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
