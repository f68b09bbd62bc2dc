"""DeepSpeed: the engine and its ZeRO optimizer, seen from the training thread.

Under ZeRO stages 1–3 every ``p.grad`` is None once ``engine.backward`` ends: the reduced
gradient the optimizer applies lives in the ZeRO optimizer's partitions, each rank holding a
disjoint piece of it. gradtrack reads this rank's pieces where they lie (no copy, no
collective) and, on a logged step, one all-gather combines every rank's statistics into the
full gradients' (`gradtrack.capture.mesh.MeshReduction`, as for FSDP2's shards). DeepSpeed's
own ``safe_get_full_grad`` would cost one collective per tensor and gather every gradient
whole on every rank.

* stage 3: ``deepspeed.utils.safe_get_local_grad`` (public), cut to the elements this rank
  holds (the last rank's partition is padded);
* stages 1 and 2: the parameter's fragment of the optimizer's reduced partition, through the
  ``_hp_mapping`` that ``safe_get_full_grad`` itself reads before its all-reduce (DeepSpeed
  has no public call for a fragment below stage 3; ``tests/test_deepspeed.py`` holds it: its
  statistics must equal ``safe_get_full_grad``'s at every stage).

A step is one step of the ZeRO optimizer: DeepSpeed calls it at the end of each gradient
accumulation window (``engine.step()`` after every micro-batch, as DeepSpeed counts steps),
when the partitions hold the window's reduced gradient. The ZeRO optimizer is no
`torch.optim.Optimizer`: `StepHooks` gives it the two hooks gradtrack needs. Stage 0 keeps
``p.grad`` (all-reduced): the engine's optimizer is watched like any data-parallel one.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


def is_engine(model: Any) -> bool:
    """Whether ``model`` is a ``deepspeed.DeepSpeedEngine`` (looked at only if imported)."""
    if "deepspeed" not in sys.modules:
        return False
    from deepspeed import DeepSpeedEngine

    return isinstance(model, DeepSpeedEngine)


def zero_stage(params: Sequence[nn.Parameter]) -> int:
    """3 for ZeRO-3's partitioned parameters, 1 for stages 1 and 2 (the same partitioned
    gradients), 0 otherwise (no ZeRO, or stage 0: plain ``p.grad``).

    >>> zero_stage([nn.Parameter(torch.zeros(2))])
    0
    """
    if any(hasattr(p, "ds_id") for p in params):
        return 3
    if any(hasattr(p, "_hp_mapping") for p in params):
        return 1
    return 0


def zero_optimizer(params: Sequence[nn.Parameter]) -> Any:
    """The ZeRO optimizer that owns ``params``' gradients, where they link to it (ZeRO-3's
    always; stages 1 and 2 only when offloading): else None."""
    for p in params:
        owner = getattr(p, "_z3_optimizer", None) or getattr(p, "_zero_optimizer", None)
        if owner is not None:
            return owner
    return None


def full_numel(param: nn.Parameter) -> int:
    """The elements of ``param``'s whole tensor (a ZeRO-3 parameter is empty between its
    forward and backward passes)."""
    return int(getattr(param, "ds_numel", 0) or param.numel())


class PartitionGrads:
    """This rank's piece of each parameter's reduced gradient, unscaled: the gradient source
    of a `Collector` under ZeRO 1–3. ``local_numel``: the elements of each piece (0: this
    rank holds none of the tensor)."""

    def __init__(self, params: Sequence[nn.Parameter], optimizer: Any, stage: int) -> None:
        self.params = list(params)
        self.optimizer = optimizer
        self.stage3 = stage == 3  # (else 1: stages 1 and 2, see `zero_stage`)
        self.local_numel = [self._held(p) for p in self.params]
        # A tensor this rank holds none of reads as empty (its statistics come from the
        # ranks that hold it), so every rank has a row for every tensor.
        self._empty = [p.new_empty(0, dtype=torch.float32) for p in self.params]

    def _held(self, p: nn.Parameter) -> int:
        if self.stage3:
            part = p.ds_tensor.numel()  # type: ignore[attr-defined]
            rank = dist.get_rank(getattr(p, "ds_process_group", None))
            return max(0, min(part, p.ds_numel - rank * part))  # type: ignore[attr-defined]
        mapping = getattr(p, "_hp_mapping", None)
        return 0 if mapping is None else int(mapping.lp_fragment_address.numel)

    def __call__(self) -> list[Tensor | None]:
        """The pieces, views into DeepSpeed's buffers (no copy unless fp16 scales them)."""
        from deepspeed.utils import safe_get_local_grad

        pieces: list[Tensor | None] = []
        for p, held, empty in zip(self.params, self.local_numel, self._empty):
            if not p.requires_grad:
                pieces.append(None)
            elif held == 0:
                pieces.append(empty)
            elif self.stage3:
                pieces.append(safe_get_local_grad(p).narrow(0, 0, held))
            else:
                mapping = p._hp_mapping  # type: ignore[attr-defined]
                pieces.append(mapping.get_lp_grad_fragment(p._index_in_param_group))  # type: ignore[attr-defined]
        scale = float(getattr(self.optimizer, "loss_scale", 1.0) or 1.0)
        if scale != 1.0:  # fp16: DeepSpeed keeps the gradients scaled until its step
            pieces = [None if t is None else t / scale for t in pieces]
        return pieces


class _Handle:
    """Removes one hook of a `StepHooks`; the last one removed gives the optimizer its own
    ``step`` back."""

    def __init__(self, owner: StepHooks, hooks: list[Callable[..., Any]], hook: Any) -> None:
        self._owner, self._hooks, self._hook = owner, hooks, hook

    def remove(self) -> None:
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)
            self._owner.restore_if_unused()


class StepHooks:
    """``register_step_pre_hook`` and ``register_step_post_hook`` for an optimizer that is no
    `torch.optim.Optimizer` (DeepSpeed's ZeRO and fp16 wrappers): its ``step`` wrapped while
    a hook is registered (an instance attribute), the hooks called around it."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self._pre: list[Callable[..., Any]] = []
        self._post: list[Callable[..., Any]] = []
        self._step: Any = None  # the wrapper, while a hook is registered
        self._had_own = False
        self._original: Any = None

    def _install(self) -> None:
        if self._step is not None:
            return
        optimizer = self.optimizer
        self._had_own = "step" in vars(optimizer)
        self._original = original = optimizer.step

        def step(opt: Any, *args: Any, **kwargs: Any) -> Any:
            for hook in list(self._pre):
                hook(opt, args, kwargs)
            result = original(*args, **kwargs)
            for hook in list(self._post):
                hook(opt, args, kwargs)
            return result

        self._step = types.MethodType(step, optimizer)
        optimizer.step = self._step

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> _Handle:
        self._install()
        self._pre.append(hook)
        return _Handle(self, self._pre, hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> _Handle:
        self._install()
        self._post.append(hook)
        return _Handle(self, self._post, hook)

    def restore_if_unused(self) -> None:
        """The optimizer's own ``step`` back once no hook is left; where something wrapped
        ours since, ours stays and calls no hook."""
        if self._pre or self._post or self._step is None:
            return
        if vars(self.optimizer).get("step") is self._step:
            if self._had_own:
                self.optimizer.step = self._original
            else:
                del self.optimizer.step
        self._step = None


def steppable(optimizer: Any) -> Any:
    """``optimizer`` as gradtrack hooks it: a DeepSpeed engine's optimizer for the engine,
    `StepHooks` around an optimizer without torch's step hooks, else itself.

    >>> sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    >>> steppable(sgd) is sgd
    True
    """
    if is_engine(optimizer):
        optimizer = optimizer.optimizer
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    return StepHooks(optimizer)
