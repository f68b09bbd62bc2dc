"""Every hook a watcher puts on the model, its parameters, its optimizer and its scaler, owned
in one place (`Probes`) and removed together; and the step evidence they gathered, by name.

Two kinds: the hooks that end a step (`StepEnd` says what they call: the `Stepper`) and the
probes that gather evidence on logged steps, as device tensors, never a host read (the output
and activation probes here, `gradtrack.capture.origin`'s `OriginProbe`,
`gradtrack.capture.distributed`'s `LocalNormProbe`). Also here:

- what the noise scale needs beyond the gradients: the examples a step saw (`BatchCounter`)
  and, under gradient accumulation in one process, each micro-batch's squared norm
  (`MicroBatchNorms`); data-parallel ranks' local norms ride in the logged step's collective;
- `AccumulationCheck`: without ``optimizer=`` a step is one backward pass; when the watched
  parameters' optimizer steps after several, those were micro-batches of one update, and the
  user is told (once) to pass ``optimizer=``;
- `ReplacementCheck`: a module or parameter assigned after `gradtrack.watch` would silently
  fall out of the records; two of torch's global registration hooks see it and say so once;
- `hooked_optimizer`: the optimizer frameworks hand out, seen through to the one that steps
  (Accelerate's ``AcceleratedOptimizer`` steps its inner one only where ``sync_gradients``
  says so; a DeepSpeed engine steps its own, `gradtrack.capture.zero`), a framework looked at
  only if the user imported it.
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, SupportsIndex

import torch
from torch import Tensor, nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from gradtrack.capture.collect import Collector
from gradtrack.capture.distributed import LocalNormProbe, RankGroup, replicated
from gradtrack.capture.layers import unwrap_model
from gradtrack.capture.origin import Origin, OriginProbe, float_tensors
from gradtrack.capture.skip import ForwardCounter, OptimizerGate
from gradtrack.capture.stats import accumulation_dtype, stored_values
from gradtrack.capture.zero import PartitionGrads, is_engine, steppable, zero_optimizer, zero_stage
from gradtrack.config import NoiseScaleOptions
from gradtrack.errors import GradtrackError
from gradtrack.handoff.layout import KeptOutputs, StepEvidence
from gradtrack.log import warn

# Where a step ends: "auto" (see `Watcher`), "manual" (the owner calls `Watcher.end_step`),
# or a predicate asked at each backward: only backwards for which it is true end a step.
StepSource = Literal["auto", "manual"] | Callable[[], bool]


class StepEnd(Protocol):
    """What the hooks that end a step call (the `gradtrack.capture.stepper.Stepper`)."""

    def boundary(self, *hook_args: Any) -> None: ...
    def end(self) -> bool: ...


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
        self._taps: dict[int, ForwardTaps] = {}

    def taps(self, module: nn.Module) -> ForwardTaps:
        """The one pair of forward hooks the probes share on ``module``."""
        taps = self._taps.get(id(module))
        if taps is None:
            taps = self._taps[id(module)] = ForwardTaps(module, self.handles)
        return taps

    def locate(self) -> Origin | None:
        """Which module made this step's NaN/Inf (`OriginProbe.locate`; None: no origin probe),
        the probes' forward hooks paused: the replay's forwards are not the step's (its
        examples, its output and the gradient reaching it are counted once, and the output
        gradient the user retained stays)."""
        if self.origin is None:
            return None
        for taps in self._taps.values():
            taps.paused = True
        try:
            return self.origin.locate()
        finally:
            for taps in self._taps.values():
                taps.paused = False

    def attach_step_source(
        self,
        model: nn.Module,
        params: list[nn.Parameter],
        optimizer: torch.optim.Optimizer | None,
        scaler: torch.amp.GradScaler | None,
        steps: StepSource,
        skipping: bool,
        on: StepEnd,
        distributed: bool = False,
    ) -> None:
        """The hooks that end each step: the scaler's update, the optimizer's step (gated
        where a rule may skip it), or the end of each backward (``steps`` a predicate: of
        those it picks). Where the owner or a predicate ends steps, an ``optimizer`` is
        stepped once per step: a skip rule's gate holds the verdict of the step just ended."""
        manual = steps == "manual"
        at_optimizer = optimizer is not None and steps == "auto"
        if scaler is not None:
            self.scaler_tap = ScalerTap(scaler, None if manual else on.boundary)
        elif optimizer is not None and skipping:
            self.gate = OptimizerGate(optimizer, on.end if at_optimizer else None)
            self.forwards = ForwardCounter(model)
            self.handles.append(self.forwards.handle)
        elif optimizer is not None and at_optimizer:
            self.handles.append(optimizer.register_step_pre_hook(on.boundary))
        if scaler is None and not at_optimizer and not manual:
            end = BackwardEnd(on.boundary, steps, after_reducer=distributed)
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
            self.output = OutputProbe(self.taps(model), is_due)
        # A replay of ZeRO-3's forward would gather parameters on this rank alone.
        zero3 = collector.partitions is not None and collector.partitions.stage3
        if records_here and not zero3:
            inner = unwrap_model(model)
            self.origin = OriginProbe(inner, is_due)
            self.taps(inner).add(self.origin.before_forward, self.origin.after_forward)
        if records_here:
            if output_modules:
                self.activations = ActivationProbe(output_modules, is_due)
                self.handles.extend(self.activations.handles)
        if replicated(ranks):
            self.local = LocalNormProbe(params, is_due)
            self.handles.extend(self.local.handles)

    def attach_noise_scale(
        self,
        model: nn.Module,
        collector: Collector,
        ranks: RankGroup | None,
        options: NoiseScaleOptions,
    ) -> None:
        """The noise scale's probes where it can be estimated (after `attach_evidence`):
        examples per step (unless the user gave the batch size) and, in one process whose
        steps are not each one backward pass, the micro-batches' norms (replicated ranks
        have their local norms already)."""
        if not options.enabled or self._is_due is None:
            return
        if ranks is not None and (not replicated(ranks) or ranks.rank != 0):
            return  # (sharded gradients: no local gradient to compare; rank 0 records)
        if options.batch_size is None:
            self.batches = BatchCounter(self.taps(model))
        if ranks is None and self.accumulation is None:
            self.micro = MicroBatchNorms(collector.params)

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
        next_due = self._is_due is not None and self._is_due()
        for taps in self._taps.values():
            taps.arm(next_due)
        micro = self.micro
        self.batch = (examples, 1 if micro is None else micro.end_step(next_due))
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
                evidence.kept_outputs,
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
        self._taps.clear()
        if self.micro is not None:
            self.micro.remove()
        if self.order is not None:
            self.order.remove()
            self.order = None
        for wrapper in (self.scaler_tap, self.gate, self.origin):
            if wrapper is not None:
                wrapper.remove()


# Compiled regions: a forward hook on a module that is compiled after gradtrack watched it
# is traced into the graph. Reading the step counter there would make dynamo guard on it
# (a recompile per step) and registering tensor hooks is a graph break, so in a compiled
# region the probes do nothing: the gradient statistics, taken from ``.grad`` outside the
# graph, are unaffected; only the forward/loss evidence and activation gradients are lost.
# A model compiled *before* watching keeps its output probe (it sits on the eager wrapper).


class ForwardTaps:
    """One forward pre-hook and one forward hook on a module, each calling the probes' own
    (``before(args, kwargs)``, ``after(output)``) in the order they were added: a hook torch
    calls costs a training step a few µs, several probes on the root module one call each.
    Its handles go to the owner's list, removed with the rest. (Hooks, not a wrapper of the
    module's ``forward``: a wrapper saved ~4 µs a short step, and broke what reads or copies
    a module's ``forward`` — `torch.export`, a shallow copy, Accelerate's regional
    compilation, a model compiled while watched; benchmarks/README.md, twentieth session on
    #39.)

    A probe that acts on due steps alone is added with ``due_only``: it is called in a due
    step and in the step after it (where it lets go of what the due step kept), not in the
    steps between — `arm`, at each step's end, says whether the next one is due. The first
    step calls every probe."""

    Before = Callable[[tuple[Any, ...], dict[str, Any]], None]
    After = Callable[[Any], None]

    def __init__(self, module: nn.Module | None, handles: list[RemovableHandle]) -> None:
        self._added: list[tuple[ForwardTaps.Before | None, ForwardTaps.After | None, bool]] = []
        self._before_calls: list[ForwardTaps.Before] = []  # those of this step, in order
        self._after_calls: list[ForwardTaps.After] = []
        self._due = True  # (the step that runs now)
        self._all = True  # every probe is called this step
        # (a replay's forward is not a step's; None: a copied module's, see `__reduce_ex__`)
        self.paused = module is None
        if module is not None:
            handles.append(module.register_forward_pre_hook(self._before, with_kwargs=True))
            handles.append(module.register_forward_hook(self._after))

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        """Copied or saved with its module (an EMA's ``copy.deepcopy``, ``torch.save(model)``),
        its hooks do nothing: the copy is not watched, and the probes (their threads and
        locks) are not copied."""
        return ForwardTaps, (None, [])

    def add(self, before: Before | None, after: After | None, due_only: bool = False) -> None:
        self._added.append((before, after, due_only))
        self._choose()

    def arm(self, due: bool) -> None:
        """The step that runs next is due (or not)."""
        every = due or self._due
        self._due = due
        if every != self._all:
            self._all = every
            self._choose()

    def _choose(self) -> None:
        called = [(b, a) for b, a, due_only in self._added if self._all or not due_only]
        self._before_calls = [b for b, _ in called if b is not None]
        self._after_calls = [a for _, a in called if a is not None]

    def _before(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.paused or torch.compiler.is_compiling():  # (see "Compiled regions" above)
            return
        for before in self._before_calls:
            before(args, kwargs)

    def _after(self, _module: nn.Module, _args: Any, output: Any) -> None:
        if self.paused or torch.compiler.is_compiling():
            return
        for after in self._after_calls:
            after(output)


def _and(previous: Tensor | None, current: Tensor) -> Tensor:
    return current if previous is None else torch.logical_and(previous, current)


# A float32 CPU output of at most this many elements (its gradients as many) is kept as it
# is, for the worker to check: where checking it here takes five small reductions and a
# Python hook, which cost a small model's logged step ~70 µs.
KEEP_OUTPUT_ELEMENTS = 65_536


class OutputProbe:
    """Is the model output finite, is the gradient that reaches it finite, and how large?

    The flags tell a non-finite forward pass or loss from a backward that broke inside the
    model; the gradient's L2 norm tells a model that fits its data (the loss sends almost no
    gradient) from one whose layers stopped passing it on. One ``isfinite().all()`` per
    output tensor and one norm per output gradient, on logged steps only — or, for a small
    float32 output on the CPU, none: the output and the gradients that reach it are kept
    (`KeptOutputs`), for the worker to check from the step's one copy. Those gradients are
    read from the outputs' ``.grad`` (retained by torch's own hook, where a Python hook costs
    the step more than the checks), an earlier forward's as the step's next one begins; where
    this probe made an output retain it, ``.grad`` is released as the next forward begins,
    as `gradtrack.capture.origin.OriginProbe` releases its own.
    """

    def __init__(self, taps: ForwardTaps, is_due: Callable[[], bool]) -> None:
        self._is_due = is_due
        self.output_finite: Tensor | None = None
        self.output_grad_finite: Tensor | None = None
        self.output_grad_norm: Tensor | None = None
        self._kept: list[Tensor] = []
        self._kept_grads: list[Tensor] = []
        self._kept_elements = 0
        self._reaching: list[Tensor] = []  # kept outputs whose gradient is still to be read
        self._retained: list[Tensor] = []  # outputs this probe made retain their gradient
        taps.add(self._before_forward, self._after_forward, due_only=True)

    def _before_forward(self, _args: tuple[Any, ...], _kwargs: dict[str, Any]) -> None:
        if self._reaching:  # (a due step's later forward: its micro-batches)
            self._read_grads()
        if self._retained:
            for leaf in self._retained:
                leaf.grad = None
            self._retained = []

    def _after_forward(self, output: Any) -> None:
        if not self._is_due():
            return
        for leaf in float_tensors(output):
            if self._keeps(leaf):
                self._kept.append(leaf.detach())
                if leaf.requires_grad:
                    self._reaching.append(leaf)
                    if not leaf.retains_grad:
                        leaf.retain_grad()
                        self._retained.append(leaf)
                continue
            with torch.no_grad():
                self.output_finite = _and(self.output_finite, torch.isfinite(leaf).all())
            if leaf.requires_grad:
                leaf.register_hook(self._output_grad)

    def _read_grads(self) -> None:
        self._kept_grads += [leaf.grad for leaf in self._reaching if leaf.grad is not None]
        self._reaching = []

    def _output_grad(self, grad: Tensor) -> None:
        with torch.no_grad():
            self.output_grad_finite = _and(self.output_grad_finite, torch.isfinite(grad).all())
            norm = torch.linalg.vector_norm(grad, dtype=accumulation_dtype(grad.dtype))
            previous = self.output_grad_norm
            self.output_grad_norm = norm if previous is None else torch.hypot(previous, norm)

    def _keeps(self, leaf: Tensor) -> bool:
        """Whether ``leaf`` is kept for the worker (its elements then counted)."""
        size = 2 * leaf.numel()  # (the output and its gradient)
        if (
            leaf.device.type != "cpu"
            or leaf.dtype != torch.float32
            or leaf.layout != torch.strided
            or (leaf.requires_grad and leaf.grad_fn is None)  # (a parameter: its .grad sums)
            or self._kept_elements + size > KEEP_OUTPUT_ELEMENTS
        ):
            return False
        self._kept_elements += size
        return True

    def take(self) -> tuple[Tensor | None, Tensor | None, Tensor | None, KeptOutputs | None]:
        """The output's finiteness, its gradient's, and that gradient's norm (None: not
        seen this step), and the outputs kept unchecked; the probe starts over."""
        if self._reaching:
            self._read_grads()
        kept = KeptOutputs(self._kept, self._kept_grads) if self._kept else None
        taken = self.output_finite, self.output_grad_finite, self.output_grad_norm, kept
        self.output_finite = self.output_grad_finite = self.output_grad_norm = None
        self._kept, self._kept_grads, self._kept_elements = [], [], 0
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


def drop_tensor_hooks(handles: list[RemovableHandle], tensors: Sequence[Tensor]) -> None:
    """Remove ``handles``, hooks put on ``tensors`` with ``register_hook``, and the hook of
    torch's own that ran them on each tensor left with none.

    Removing a handle only empties the tensor's hook dict: torch's hook stays and calls into
    Python at every backward to find it empty (~0.5 µs a tensor a step, for as long as the
    parameter lives). Setting the dict to None takes it off; a post-accumulate hook's cannot
    be taken off, so a hook that is put on for a while is a ``register_hook`` one."""
    for handle in handles:
        handle.remove()
    handles.clear()
    for tensor in tensors:
        hooks = tensor._backward_hooks
        if hooks is not None and not hooks:
            tensor._backward_hooks = None


class BackwardOrderProbe:
    """Learns, from one backward pass, the order in which layers' gradients become ready
    (a hook on each parameter before its gradient is accumulated, taken off after)."""

    def __init__(self, params: list[nn.Parameter], layer_of: dict[int, int]) -> None:
        self.order: list[int] = []
        self._seen: set[int] = set()
        self._params = [p for p in params if p.requires_grad]
        self.handles: list[RemovableHandle] = [
            p.register_hook(functools.partial(self._ready, layer_of[id(p)])) for p in self._params
        ]

    def _ready(self, layer: int, _grad: Tensor) -> None:
        if layer not in self._seen:
            self._seen.add(layer)
            self.order.append(layer)

    def remove(self) -> None:
        drop_tensor_hooks(self.handles, self._params)


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

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        """Copied or saved with the modules (`ForwardTaps.__reduce_ex__`): one that does
        nothing."""
        return _idle_activations, ()

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


def _idle_activations() -> ActivationProbe:
    """A copied module's `ActivationProbe`: never due, so its hooks do nothing."""
    return ActivationProbe([], lambda: False)


class BatchCounter:
    """Examples per step: the first dimension of the model's first tensor input, summed over
    the step's forward passes (host shapes only: no device work). Counted on due steps (the
    noise scale's); a step between them, recorded only where it went bad, repeats the last
    count."""

    def __init__(self, taps: ForwardTaps) -> None:
        self.examples = 0
        self._counted = 0
        taps.add(self._count, None, due_only=True)

    def _count(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, Tensor):
                self.examples += value.shape[0] if value.dim() else 1
                return

    def take(self) -> int:
        if self.examples:
            self._counted, self.examples = self.examples, 0
        return self._counted


class MicroBatchNorms:
    """Gradient accumulation in one process: the backward passes of each step (one hook, on
    the first trainable parameter) and, on logged steps, the sum over micro-batches of each
    tensor's squared incoming gradient — a hook before accumulation into ``.grad`` sees the
    micro-batch's own contribution, so no gradient is copied.

    Its per-tensor hooks are on only during the steps that are due (put on at the end of
    the step before, taken off at their end), once a step was seen to take several backward
    passes. The backward passes are counted (one hook, on the first trainable parameter) on
    the first step and the due ones alone: another step, recorded only where it went bad,
    repeats the last count; a hook the autograd engine calls costs a step ~2 µs.
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        self._params = [p for p in params if p.requires_grad]
        self._index = {id(p): i for i, p in enumerate(params)}
        self._n_tensors = len(params)
        self.backwards = 0
        # Each incoming gradient's norm (one kernel in the hook) and its tensor's index; the
        # squares are summed per tensor at the step's end, in three batched kernels.
        self._norms: list[Tensor] = []
        self._tensors: list[int] = []
        self._index_cache: tuple[tuple[int, ...], Tensor] | None = None
        self._per_tensor: list[RemovableHandle] = []  # on for a due step only
        self._accumulates = False  # a step took several backward passes
        self._counter: RemovableHandle | None = None  # counting this step's backward passes
        self._counted = 1  # the last count
        self._count(True)

    def _count(self, on: bool) -> None:
        if on and self._counter is None and self._params:
            self._counter = self._params[0].register_post_accumulate_grad_hook(self._backward)
        elif not on and self._counter is not None:
            self._counter.remove()
            self._counter = None

    def _backward(self, param: Tensor) -> None:
        self.backwards += 1

    def end_step(self, next_due: bool) -> int:
        """The step's backward passes (the last count, where this step was not counted); the
        next step counted and each tensor hooked for it if it is ``next_due``."""
        if self._counter is not None:
            self._counted, self.backwards = self.backwards, 0
            self._accumulates = self._accumulates or self._counted > 1
        self._count(next_due)
        due = self._accumulates and next_due
        if due and not self._per_tensor:
            for param in self._params:
                index = self._index[id(param)]
                self._per_tensor.append(param.register_hook(lambda g, i=index: self._add(i, g)))
        elif not due and self._per_tensor:
            drop_tensor_hooks(self._per_tensor, self._params)
        return self._counted

    def remove(self) -> None:
        """Take every hook off."""
        self._count(False)
        drop_tensor_hooks(self._per_tensor, self._params)

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


class ReplacementCheck:
    """Warns once when a module of ``model`` gets a new submodule or parameter."""

    def __init__(self, model: nn.Module) -> None:
        self._paths: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary(
            {module: name for name, module in model.named_modules()}
        )
        self.warned = False
        self.handles: list[RemovableHandle] = [
            register_module_module_registration_hook(self._registered),
            register_module_parameter_registration_hook(self._registered),
        ]

    def _registered(self, module: nn.Module, name: str, value: Any) -> None:
        path = self._paths.get(module)
        if path is None or self.warned or value is None:
            return
        self.warned = True
        where = f"{path}.{name}" if path else name
        try:  # a warning turned into an error must not stop the user's assignment
            warnings.warn(
                f"{where} was assigned after gradtrack.watch: gradtrack watches the parameters "
                "the model had then, so its gradients are not in the records; call "
                "gradtrack.unwatch(model) and watch it again after changing the model",
                RuntimeWarning,
                stacklevel=3,
            )
        except Exception:
            pass


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
