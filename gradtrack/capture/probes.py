"""Every hook a watcher puts on the model, its parameters, its optimizer and its scaler, owned
in one place and removed together; and the step evidence they gathered, by name.

Two kinds: the hooks that end a step (`StepHooks` says what they call) and the probes that
gather evidence on logged steps (`gradtrack.capture.hooks`, `gradtrack.capture.origin`,
`LocalNormProbe`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradtrack.capture.accumulation import AccumulationCheck
from gradtrack.capture.collect import Collector
from gradtrack.capture.distributed import LocalNormProbe, RankGroup
from gradtrack.capture.hooks import ActivationProbe, BackwardOrderProbe, OutputProbe, ScalerTap
from gradtrack.capture.layers import unwrap_model
from gradtrack.capture.noise_probes import BatchCounter, MicroBatchNorms
from gradtrack.capture.origin import OriginProbe
from gradtrack.capture.replaced import ReplacementCheck
from gradtrack.capture.skip import ForwardCounter, OptimizerGate
from gradtrack.config import NoiseScaleOptions
from gradtrack.handoff.evidence import StepEvidence
from gradtrack.log import warn

# Where a step ends: "auto" (see `Watcher`), "manual" (the owner calls `Watcher.end_step`),
# or a predicate asked at each backward: only backwards for which it is true end a step.
StepSource = Literal["auto", "manual"] | Callable[[], bool]


class StepHooks(Protocol):
    """What the hooks that end a step call (a `Watcher`)."""

    def _step_boundary(self) -> None: ...
    def _before_optimizer_step(self, *args: Any) -> None: ...
    def _after_optimizer_step(self, *args: Any) -> None: ...
    def _end_step(self) -> bool: ...


class BackwardEnd:
    """Ends a step at the end of each backward pass (of those ``steps`` picks, where it is a
    predicate): the first gradient ready queues ``end`` to run once autograd has finished."""

    def __init__(self, end: Callable[[], None], steps: StepSource, after_reducer: bool) -> None:
        self._end = end
        self._picks = steps if callable(steps) else None
        self._after_reducer = after_reducer
        self._queued_for_task = -1  # the backward (graph task) whose end is already queued

    def grad_ready(self, _param: torch.Tensor) -> None:
        # Cheap on purpose: it runs for every parameter on every backward. Keyed by graph
        # task, so a backward that raised before its end cannot block the next one.
        task = torch._C._current_graph_task_id()
        if task != self._queued_for_task:
            self._queued_for_task = task
            if self._picks is not None and not self._picks():
                return  # e.g. a gradient-accumulation micro-batch
            end = self._end if not self._after_reducer else self._queue_end
            torch.autograd.Variable._execution_engine.queue_callback(end)

    def _queue_end(self) -> None:
        # DDP queues its own end-of-backward callback (copying the all-reduced gradients
        # back) after ours was queued; a callback queued now runs after it.
        torch.autograd.Variable._execution_engine.queue_callback(self._end)


class Probes:
    """The hooks of one watcher. ``remove`` leaves the model, optimizer and scaler as they
    were; it is safe to call after a partial attach."""

    def __init__(self) -> None:
        self.handles: list[RemovableHandle] = []
        self.scaler_tap: ScalerTap | None = None
        self.gate: OptimizerGate | None = None
        self.forwards: ForwardCounter | None = None
        self.accumulation: AccumulationCheck | None = None
        self.order: BackwardOrderProbe | None = None
        self.output: OutputProbe | None = None
        self.origin: OriginProbe | None = None
        self.activations: ActivationProbe | None = None
        self.local: LocalNormProbe | None = None
        self.batches: BatchCounter | None = None
        self.micro: MicroBatchNorms | None = None
        self.batch = (0, 1)  # the last step's examples and backward passes (`end_step`)
        self._micro_squares: torch.Tensor | None = None
        self._warned_no_activations = False
        self._is_due: Callable[[], bool] | None = None  # (`attach_evidence`'s)

    def attach_step_source(
        self,
        model: nn.Module,
        params: list[nn.Parameter],
        optimizer: torch.optim.Optimizer | None,
        scaler: torch.amp.GradScaler | None,
        steps: StepSource,
        skipping: bool,
        on: StepHooks,
        distributed: bool = False,
    ) -> None:
        """The hooks that end each step: the scaler's update, the optimizer's step (gated
        where a rule may skip it), or the end of each backward (``steps`` a predicate: of
        those it picks). Where the owner or a predicate ends steps, an ``optimizer`` is
        stepped once per step: a skip rule's gate holds the verdict of the step just ended."""
        manual = steps == "manual"
        at_optimizer = optimizer is not None and steps == "auto"
        if scaler is not None:
            self.scaler_tap = ScalerTap(scaler, None if manual else on._step_boundary)
        elif optimizer is not None and skipping:
            self.gate = OptimizerGate(optimizer, on._end_step if at_optimizer else None)
            self.forwards = ForwardCounter(model)
            self.handles.append(self.forwards.handle)
        elif optimizer is not None and at_optimizer:
            self.handles.append(optimizer.register_step_pre_hook(on._before_optimizer_step))
        if scaler is None and not at_optimizer and not manual:
            end = BackwardEnd(on._step_boundary, steps, after_reducer=distributed)
            for param in params:
                if param.requires_grad:
                    self.handles.append(param.register_post_accumulate_grad_hook(end.grad_ready))
            if steps == "auto":  # one step per backward: tell accumulation apart
                self.accumulation = AccumulationCheck(params)
                self.handles.append(self.accumulation.handle)
        self.handles.extend(ReplacementCheck(unwrap_model(model)).handles)

    def attach_evidence(
        self,
        model: nn.Module,
        collector: Collector,
        ranks: RankGroup | None,
        output_modules: list[nn.Module],
        is_due: Callable[[], bool],
    ) -> None:
        """The probes that gather a logged step's evidence. Forward evidence is read only where
        records are made, but for the output's under sharding: each rank's travels to rank 0
        with its rows, naming where a NaN arose."""
        self._is_due = is_due
        params = collector.params
        layer_of = {id(p): int(i) for p, i in zip(params, collector.index.tensor_layer)}
        self.order = BackwardOrderProbe(params, layer_of)
        records_here = ranks is None or ranks.rank == 0
        if records_here or collector.mesh is not None:
            self.output = OutputProbe(model, is_due)
            self.handles.append(self.output.handle)
        # A replay of ZeRO-3's forward would gather parameters on this rank alone.
        zero3 = collector.partitions is not None and collector.partitions.stage3
        if records_here and not zero3:
            self.origin = OriginProbe(unwrap_model(model))
        if records_here:
            if output_modules:
                self.activations = ActivationProbe(output_modules, is_due)
                self.handles.extend(self.activations.handles)
        if ranks is not None and ranks.layout == "replicated":
            self.local = LocalNormProbe(params, is_due)
            self.handles.extend(self.local.handles)

    def attach_noise_scale(
        self, model: nn.Module, collector: Collector, ranks: RankGroup | None,
        options: NoiseScaleOptions,
    ) -> None:  # fmt: skip
        """The noise scale's probes where it can be estimated (after `attach_evidence`):
        examples per step (unless the user gave the batch size) and, in one process whose
        steps are not each one backward pass, the micro-batches' norms (replicated ranks
        have their local norms already)."""
        if not options.enabled or self._is_due is None:
            return
        if ranks is not None and (ranks.layout != "replicated" or ranks.rank != 0):
            return  # (sharded gradients: no local gradient to compare; rank 0 records)
        if options.batch_size is None:
            self.batches = BatchCounter(model)
            self.handles.append(self.batches.handle)
        if ranks is None and self.accumulation is None:
            self.micro = MicroBatchNorms(collector.params, self._is_due)
            self.handles.extend(self.micro.handles)

    def backward_order(self) -> list[int] | None:
        """The order layers' gradients became ready in, once: learnt from the first backward."""
        probe = self.order
        if probe is None or not probe.order:
            return None
        probe.remove()
        self.order = None
        return probe.order

    def end_step(self) -> list[int]:
        """The step's end: the forward passes of each micro-batch since the last step (skip's
        journal). The noise scale's counts are kept for the step: its examples (0: not
        counted) and backward passes (``batch``), and its micro-batches' squared norms (for
        `evidence`)."""
        examples = 0 if self.batches is None else self.batches.take()
        micro = self.micro
        self.batch = (examples, 1 if micro is None else micro.end_step())
        self._micro_squares = None if micro is None else micro.take()
        return self.forwards.take() if self.forwards is not None else []

    def evidence(self) -> tuple[StepEvidence, list[int] | None]:
        """The step's evidence from the probes, and the order in which activation gradients
        arrived."""
        evidence = StepEvidence(micro_squares=self._micro_squares)
        if self.output is not None:
            (
                evidence.output_finite,
                evidence.output_grad_finite,
                evidence.output_grad_norm,
            ) = self.output.take()
        if self.scaler_tap is not None:
            taken = self.scaler_tap.evidence()
            if taken is not None:
                evidence.amp_found_inf, evidence.amp_scale, evidence.amp_scale_after = taken
        order = None
        if self.activations is not None:
            evidence.activation_norms, order = self.activations.take()
            if not order and not self._warned_no_activations:
                self._warned_no_activations = True
                warn(
                    "activations=True saw no activation gradient this step: forward hooks do "
                    "not run inside a graph compiled after gradtrack.watch (compile first, "
                    "then watch), or the step had no backward through the watched modules",
                    stacklevel=5,
                )
        return evidence, order

    def remove(self) -> None:
        """Remove every hook and wrapper."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.micro is not None:
            self.micro.remove()
        if self.order is not None:
            self.order.remove()
            self.order = None
        for wrapper in (self.scaler_tap, self.gate, self.origin):
            if wrapper is not None:
                wrapper.remove()
