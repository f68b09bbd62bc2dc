"""Optimizer-aware signals, exactly (``update_signals=True``): each parameter's norm and the
norm of the update the optimizer actually applied (weight decay, momentum and Adam's
preconditioning included).

ΔW is measured, not derived from the optimizer's state: on a logged step the parameters are
copied, before ``optimizer.step()``, into buffers made once and reused (one copy of the
trainable parameters, for the run), and subtracted from after it. Unlogged steps pay nothing.
The default estimates ‖ΔW‖ from a sample instead (`gradtrack.capture.update_sample`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from gradtrack.capture.stats import DeviceIndex, accumulation_dtype, copy_to_host


class UpdateProbe:
    """`before` and `after` one optimizer step: per tensor, (‖W before‖, ‖W after − W before‖)
    as a float64 ``[tensors, 2]`` tensor on the first device, copied to the host without a
    wait (`stats.copy_to_host`)."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self._params = list(params)
        self._groups, self._inverse = device_groups(self._params)
        self._index = DeviceIndex()
        self._snapshots: list[list[Tensor]] | None = None
        self._param_norms: list[Tensor] = []

    def before(self) -> None:
        """Copy the weights (into the reused buffers) and take their norms."""
        with torch.no_grad():
            weights = [[self._params[i].detach() for i in group] for group in self._groups]
            if self._snapshots is None:
                self._snapshots = [[torch.empty_like(w) for w in ws] for ws in weights]
            self._param_norms = []
            for snapshot, ws in zip(self._snapshots, weights):
                torch._foreach_copy_(snapshot, ws)
                self._param_norms.append(weight_norms(ws))

    def after(self) -> tuple[Tensor, torch.cuda.Event | None]:
        """The step's rows, in the order of ``params``, and the event its host copy sets."""
        assert self._snapshots is not None, "after() without before()"
        with torch.no_grad():
            updates = []
            for group, snapshot in zip(self._groups, self._snapshots):
                torch._foreach_sub_(snapshot, [self._params[i].detach() for i in group])
                updates.append(weight_norms(snapshot))
            device = self._param_norms[0].device
            rows = torch.stack(
                [
                    torch.cat([n.to(device) for n in self._param_norms]),
                    torch.cat([n.to(device) for n in updates]),
                ],
                dim=1,
            )
            return copy_to_host(rows[self._index(self._inverse, device)])


def device_groups(params: Sequence[Tensor]) -> tuple[list[list[int]], np.ndarray]:
    """The tensors' indices grouped by (device, dtype), for one foreach pass per group, and
    the permutation that puts the groups' concatenated results back in tensor order."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, param in enumerate(params):
        groups[(param.device, param.dtype)].append(i)
    ordered = list(groups.values())
    return ordered, np.argsort(np.concatenate([np.asarray(g) for g in ordered]))


def weight_norms(tensors: list[Tensor]) -> Tensor:
    """float64 L2 norms (fp32 accumulation for fp16/bf16 weights)."""
    accumulate = accumulation_dtype(tensors[0].dtype)
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=accumulate)).double()
