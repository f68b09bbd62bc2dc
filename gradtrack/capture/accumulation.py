"""Gradient accumulation without ``optimizer=``: one record per micro-batch, said once.

Without an optimizer a step is one backward pass. When the watched parameters' optimizer then
steps after several backward passes, those were micro-batches of one update: the records
describe partial gradients, so the user is told (once) to pass ``optimizer=``.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook


class AccumulationCheck:
    """Counts backward passes between steps of any optimizer holding a watched parameter
    (a hook shared by all optimizers: it sees an optimizer gradtrack was not given)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self._watched = {id(p) for p in params}
        self._holds: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = (
            weakref.WeakKeyDictionary()
        )
        self.backwards = 0
        self.warned = False
        self.handle = register_optimizer_step_pre_hook(self._before_step)

    def backward(self) -> None:
        self.backwards += 1

    def _before_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        holds = self._holds.get(optimizer)
        if holds is None:
            params = (p for group in optimizer.param_groups for p in group["params"])
            holds = self._holds[optimizer] = any(id(p) in self._watched for p in params)
        if not holds:
            return
        if self.backwards > 1 and not self.warned:
            self.warned = True
            try:  # a warning turned into an error must not stop optimizer.step()
                warnings.warn(
                    f"gradtrack saw {self.backwards} backward passes before this "
                    f"{type(optimizer).__name__}.step(): without optimizer= each backward is a "
                    "step, so its records describe micro-batches, not the accumulated gradient "
                    "the optimizer applies; pass gradtrack.watch(model, optimizer=optimizer)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            except Exception:
                pass
        self.backwards = 0
