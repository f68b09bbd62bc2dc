"""Probes gradtrack attaches to a model or a GradScaler, each removable without a trace.

They gather step evidence as device tensors — never a host read — on steps that are logged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from gradtrack.capture.stats import accumulation_dtype
from gradtrack.errors import GradtrackError

# Compiled regions: a forward hook on a module that is compiled after gradtrack watched it
# is traced into the graph. Reading the step counter there would make dynamo guard on it
# (a recompile per step) and registering tensor hooks is a graph break, so in a compiled
# region the probes do nothing: the gradient statistics, taken from ``.grad`` outside the
# graph, are unaffected; only the forward/loss evidence and activation gradients are lost.
# A model compiled *before* watching keeps its output probe (it sits on the eager wrapper).


def _and(previous: Tensor | None, current: Tensor) -> Tensor:
    return current if previous is None else torch.logical_and(previous, current)


def float_tensors(value: Any) -> list[Tensor]:
    """The floating-point tensors in a module's output (or inputs): a nest of tuples, lists
    and dicts walked only where the value is not one tensor (the usual output)."""
    if type(value) is Tensor:
        return [value] if value.is_floating_point() else []
    return [t for t in tree_leaves(value) if isinstance(t, Tensor) and t.is_floating_point()]


class OutputProbe:
    """Is the model output finite, is the gradient that reaches it finite, and how large?

    The flags tell a non-finite forward pass or loss from a backward that broke inside the
    model; the gradient's L2 norm tells a model that fits its data (the loss sends almost no
    gradient) from one whose layers stopped passing it on. One ``isfinite().all()`` per
    output tensor and one norm per output gradient, on logged steps only.
    """

    def __init__(self, model: nn.Module, is_due: Callable[[], bool]) -> None:
        self._is_due = is_due
        self.output_finite: Tensor | None = None
        self.output_grad_finite: Tensor | None = None
        self.output_grad_norm: Tensor | None = None
        self.handle = model.register_forward_hook(self._after_forward)

    def _after_forward(self, _module: nn.Module, _args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or not self._is_due():
            return  # inside a compiled graph: see "Compiled regions" above
        for leaf in float_tensors(output):
            with torch.no_grad():
                self.output_finite = _and(self.output_finite, torch.isfinite(leaf).all())
            if leaf.requires_grad:
                leaf.register_hook(self._output_grad)

    def _output_grad(self, grad: Tensor) -> None:
        with torch.no_grad():
            self.output_grad_finite = _and(self.output_grad_finite, torch.isfinite(grad).all())
            norm = torch.linalg.vector_norm(grad, dtype=accumulation_dtype(grad.dtype))
            previous = self.output_grad_norm
            self.output_grad_norm = norm if previous is None else torch.hypot(previous, norm)

    def take(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """The output's finiteness, its gradient's, and that gradient's norm (None: not
        seen this step); the probe starts over."""
        taken = self.output_finite, self.output_grad_finite, self.output_grad_norm
        self.output_finite = self.output_grad_finite = self.output_grad_norm = None
        return taken


class ScalerTap:
    """Makes ``scaler.update()`` the step boundary, where gradients are already unscaled and
    the scaler knows (on the device) whether it skipped the step. Without ``on_update`` it
    only reads that evidence (the owner ends steps after ``unscale_``)."""

    def __init__(self, scaler: torch.amp.GradScaler, on_update: Callable[[], None] | None) -> None:
        self.scaler = scaler
        self._wraps_update = on_update is not None
        if on_update is None:
            return
        if "update" in vars(scaler):
            raise GradtrackError(
                "this GradScaler is already watched (its update() is wrapped): one watcher per "
                "scaler; close the other watcher first"
            )
        original = scaler.update

        def update(new_scale: Any = None) -> None:
            on_update()
            original(new_scale)

        scaler.update = update  # type: ignore[method-assign]

    def evidence(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """(found_inf, scale, scale after update) as device tensors, or None if disabled."""
        scaler = self.scaler
        if not scaler.is_enabled() or scaler._scale is None:
            return None
        found = [
            found_inf
            for state in scaler._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        if not found:
            return None
        scale = scaler._scale.double()
        found_inf = torch.stack([f.to(scale.device, non_blocking=True) for f in found]).sum()
        after = torch.where(found_inf > 0, scale * scaler.get_backoff_factor(), scale)
        return found_inf.double(), scale, after

    def remove(self) -> None:
        if self._wraps_update:
            vars(self.scaler).pop("update", None)


class BackwardOrderProbe:
    """Learns, from one backward pass, the order in which layers' gradients become ready."""

    def __init__(self, params: list[nn.Parameter], layer_of: dict[int, int]) -> None:
        self.order: list[int] = []
        self._seen: set[int] = set()
        self._layer_of = layer_of
        self.handles: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._ready) for p in params if p.requires_grad
        ]

    def _ready(self, param: Tensor) -> None:
        layer = self._layer_of[id(param)]
        if layer not in self._seen:
            self._seen.add(layer)
            self.order.append(layer)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


class ActivationProbe:
    """Norms of the gradients w.r.t. module outputs — the recipe's "gradient flow" — on
    logged steps. Several calls of one module in a step (micro-batches, reuse) add up as
    the root of the summed squares."""

    def __init__(self, modules: list[nn.Module], is_due: Callable[[], bool]) -> None:
        self._is_due = is_due
        self.norms: list[Tensor | None] = [None] * len(modules)
        self.order: list[int] = []  # module indices, in the order their output grads arrived
        self.handles = [
            module.register_forward_hook(functools.partial(self._after_forward, index))
            for index, module in enumerate(modules)
        ]

    def _after_forward(self, index: int, _module: nn.Module, _args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or not self._is_due():
            return  # inside a compiled graph: see "Compiled regions" above
        for leaf in float_tensors(output):
            if leaf.requires_grad:
                leaf.register_hook(functools.partial(self._output_grad, index))

    def _output_grad(self, index: int, grad: Tensor) -> None:
        with torch.no_grad():
            squared = (
                torch.linalg.vector_norm(grad, dtype=accumulation_dtype(grad.dtype))
                .double()
                .square()
            )
            previous = self.norms[index]
            if previous is None:
                self.order.append(index)
            self.norms[index] = squared if previous is None else previous + squared

    def take(self) -> tuple[list[Tensor | None], list[int]]:
        norms = [None if n is None else n.sqrt() for n in self.norms]
        order = self.order
        self.norms, self.order = [None] * len(self.norms), []
        return norms, order
