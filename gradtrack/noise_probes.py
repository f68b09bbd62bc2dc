"""What the noise scale (`gradtrack.noise_scale`) needs from the training thread, beyond the
gradients gradtrack reads anyway: how many examples a step saw, and, under gradient
accumulation in one process, each micro-batch's squared gradient norm.

Data-parallel ranks need nothing new: their local norms, before the all-reduce, already ride
in the one collective of a logged step (`gradtrack.distributed.LocalNormProbe`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from gradtrack.stats import accumulation_dtype


class BatchCounter:
    """Examples per step: the first dimension of the model's first tensor input, summed over
    the step's forward passes (host shapes only: no device work)."""

    def __init__(self, model: nn.Module) -> None:
        self.examples = 0
        self.handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, Tensor):
                self.examples += value.shape[0] if value.dim() else 1
                return

    def take(self) -> int:
        examples, self.examples = self.examples, 0
        return examples


class MicroBatchNorms:
    """Gradient accumulation in one process: the backward passes of each step (one hook, on
    the first trainable parameter) and, on logged steps, the sum over micro-batches of each
    tensor's squared incoming gradient — a hook before accumulation into ``.grad`` sees the
    micro-batch's own contribution, so no gradient is copied.

    Its per-tensor hooks go on only once a step was seen to take several backward passes:
    a run without accumulation pays one hook call per backward.
    """

    def __init__(self, params: list[nn.Parameter], is_due: Callable[[], bool]) -> None:
        self._params = [p for p in params if p.requires_grad]
        self._index = {id(p): i for i, p in enumerate(params)}
        self._n_tensors = len(params)
        self._is_due = is_due
        self.backwards = 0
        self._sums: list[Tensor | None] = [None] * len(params)
        self._any = False  # whether a hook added to ``_sums`` since the last take
        self.handles: list[RemovableHandle] = []
        self._hooked = False
        if self._params:
            first = self._params[0]
            self.handles.append(first.register_post_accumulate_grad_hook(self._backward))

    def _backward(self, param: Tensor) -> None:
        self.backwards += 1

    def end_step(self) -> int:
        """The step's backward passes; hook every tensor once a step had several."""
        backwards, self.backwards = self.backwards, 0
        if backwards > 1 and not self._hooked:
            self._hooked = True
            for param in self._params:
                index = self._index[id(param)]
                self.handles.append(param.register_hook(lambda g, i=index: self._add(i, g)))
        return backwards

    @property
    def hooked(self) -> bool:
        return self._hooked

    def _add(self, index: int, grad: Tensor) -> None:
        if not self._is_due():
            return
        if grad.is_sparse:
            grad = grad.coalesce()._values()
        with torch.no_grad():
            square = torch.linalg.vector_norm(grad, dtype=accumulation_dtype(grad.dtype)).square()
            total = self._sums[index]
            self._sums[index] = square if total is None else total + square
            self._any = True

    def take(self) -> Tensor | None:
        """float64 [tensors]: the step's sums of squared micro-batch gradients (0 where a
        tensor had none); None if no hook ran."""
        if not self._any:
            return None
        sums, self._sums, self._any = self._sums, [None] * self._n_tensors, False
        device = self._params[0].device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return torch.stack(
            [zero if s is None else s.to(device, torch.float64, non_blocking=True) for s in sums]
        )
