"""What the noise scale (`gradtrack.worker.noise_scale`) needs from the training thread, beyond the
gradients gradtrack reads anyway: how many examples a step saw, and, under gradient
accumulation in one process, each micro-batch's squared gradient norm.

Data-parallel ranks need nothing new: their local norms, before the all-reduce, already ride
in the one collective of a logged step (`gradtrack.capture.distributed.LocalNormProbe`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from gradtrack.capture.stats import accumulation_dtype, stored_values


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

    Its per-tensor hooks are on only during the steps that are due (put on at the end of
    the step before, taken off at their end), once a step was seen to take several backward
    passes: other steps, and a run without accumulation, pay one hook call per backward.
    """

    def __init__(self, params: list[nn.Parameter], is_due: Callable[[], bool]) -> None:
        self._params = [p for p in params if p.requires_grad]
        self._index = {id(p): i for i, p in enumerate(params)}
        self._n_tensors = len(params)
        self._is_due = is_due
        self.backwards = 0
        # Each incoming gradient's norm (one kernel in the hook) and its tensor's index; the
        # squares are summed per tensor at the step's end, in three batched kernels.
        self._norms: list[Tensor] = []
        self._tensors: list[int] = []
        self._index_cache: tuple[tuple[int, ...], Tensor] | None = None
        self.handles: list[RemovableHandle] = []
        self._per_tensor: list[RemovableHandle] = []  # on for a due step only
        self._accumulates = False  # a step took several backward passes
        if self._params:
            first = self._params[0]
            self.handles.append(first.register_post_accumulate_grad_hook(self._backward))

    def _backward(self, param: Tensor) -> None:
        self.backwards += 1

    def end_step(self) -> int:
        """The step's backward passes; each tensor hooked for the next step if it is due."""
        backwards, self.backwards = self.backwards, 0
        self._accumulates = self._accumulates or backwards > 1
        due = self._accumulates and self._is_due()
        if due and not self._per_tensor:
            for param in self._params:
                index = self._index[id(param)]
                self._per_tensor.append(param.register_hook(lambda g, i=index: self._add(i, g)))
        elif not due and self._per_tensor:
            self.remove()
        return backwards

    def remove(self) -> None:
        """Take the per-tensor hooks off (the backward counter is in ``handles``, which the
        owner removes with its own)."""
        for handle in self._per_tensor:
            handle.remove()
        self._per_tensor.clear()

    def _add(self, index: int, grad: Tensor) -> None:
        grad = stored_values(grad)
        with torch.no_grad():
            self._norms.append(torch.linalg.vector_norm(grad, dtype=accumulation_dtype(grad.dtype)))
        self._tensors.append(index)

    def take(self) -> Tensor | None:
        """float64 [tensors]: the step's sums of squared micro-batch gradients (0 where a
        tensor had none); None if no hook ran."""
        if not self._norms:
            return None
        norms, tensors, self._norms, self._tensors = self._norms, self._tensors, [], []
        device = self._params[0].device
        squares = torch.stack([n.to(device, torch.float64, non_blocking=True) for n in norms])
        index = self._index_on(tuple(tensors), device)
        sums = torch.zeros(self._n_tensors, dtype=torch.float64, device=device)
        return sums.index_add_(0, index, squares.square())

    def _index_on(self, tensors: tuple[int, ...], device: torch.device) -> Tensor:
        """The hooks' tensor order on the device, made once: each backward calls them in the
        same order, and a copy from a host list to an accelerator waits for its stream."""
        cached = self._index_cache
        if cached is None or cached[0] != tensors or cached[1].device != device:
            cached = self._index_cache = (tensors, torch.tensor(tensors, device=device))
        return cached[1]
