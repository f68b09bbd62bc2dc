"""`Watcher`: the lifecycle of watching one model — hooks, step counting, the worker.

Built by `gradtrack.watch`; closing it removes every hook it added and flushes the sinks.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradtrack import lifecycle
from gradtrack.accumulation import AccumulationCheck
from gradtrack.alerts import AlertEngine, AlertEvent
from gradtrack.assemble import AssembledStep, Assembler, FirstInWindow, PendingStep
from gradtrack.collect import Collector, Guard
from gradtrack.config import GradtrackConfig
from gradtrack.courier import DropCount
from gradtrack.distributed import (
    LocalNormProbe,
    RankGroup,
    is_dtensor,
    local_tensor,
    rank_group,
)
from gradtrack.errors import GradientAlertError, GradtrackError
from gradtrack.hooks import ActivationProbe, BackwardOrderProbe, OutputProbe, ScalerTap
from gradtrack.latch import BadStepLatch
from gradtrack.layers import (
    activation_modules,
    discover_layers,
    layer_kinds,
    saturating_layers,
    unwrap_model,
)
from gradtrack.lifecycle import Outcome, outcome_of
from gradtrack.log import logger, report, warn
from gradtrack.mesh import MeshReduction
from gradtrack.origin import OriginProbe, nonfinite_weight_layers
from gradtrack.replaced import ReplacementCheck
from gradtrack.schedule import layer_schedule
from gradtrack.sinks.base import GradientSink
from gradtrack.skip import ForwardCounter, Journal, OptimizerGate, Skip, SkipPolicy
from gradtrack.spike import LayerNorms, NormWindow, on_host, spike_fields
from gradtrack.updates import UpdateProbe
from gradtrack.worker import Mailbox, Worker

AlertCallback = Callable[[AlertEvent], None]
# Where a step ends: "auto" (see `Watcher`), "manual" (the owner calls `Watcher.end_step`),
# or a predicate asked at each backward: only backwards for which it is true end a step.
StepSource = Literal["auto", "manual"] | Callable[[], bool]

_WATCHED: weakref.WeakKeyDictionary[nn.Module, Watcher] = weakref.WeakKeyDictionary()


class Watcher:
    """Watches one model's gradients until closed. Use it as a context manager or call `close`.

    ``step`` counts ``scaler.update()`` calls when a GradScaler is given, else optimizer steps
    when an optimizer is given, else backward passes; a step ``s`` is summarised when
    ``s % log_every == 0`` and sampled when ``s % hist_every == 0``.
    """

    def __init__(
        self,
        model: nn.Module,
        sinks: Sequence[GradientSink],
        config: GradtrackConfig,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: torch.amp.GradScaler | None = None,
        on_alert: AlertCallback | None = None,
        steps: StepSource = "auto",
    ) -> None:
        inner = unwrap_model(model)
        if inner in _WATCHED:
            raise GradtrackError(
                f"this {type(inner).__name__} is already watched; call gradtrack.unwatch(model) "
                "or close the first watcher before watching it again"
            )
        self.model_ref = weakref.ref(inner)
        self.config = config
        self.layers = discover_layers(inner, config)
        self.collector = Collector(self.layers, config.hist_sample_size, config.seed)
        self.collector.local_shards = any(is_dtensor(p) for p in self.collector.params)
        self.ranks: RankGroup | None = None
        if config.distributed.enabled:
            self.ranks = rank_group(model, self.collector.params)
        rank = 0 if self.ranks is None else self.ranks.rank
        ends_steps = optimizer is not None or scaler is not None or steps == "manual"
        if self.collector.local_shards and not ends_steps:
            raise GradtrackError(
                "watching a sharded (FSDP2) model needs optimizer= (or scaler=, or "
                "steps='manual'): its gradients are complete only once backward has "
                "reduce-scattered them"
            )
        self.mesh: MeshReduction | None = None
        if self.ranks is not None and self.ranks.layout == "sharded":
            self.mesh = self._mesh_reduction(self.ranks)
        elif self.collector.local_shards:  # each rank on its own: statistics of its shards
            local = [local_tensor(p) for p in self.collector.params]
            self.collector.tensor_numel = np.array([t.numel() for t in local], dtype=np.int64)
        self.drops = DropCount(report)
        self.mailbox = Mailbox(
            config.queue_size, config.queue_full, self.drops, config.queue_mib << 20
        )
        watched_outputs = activation_modules(inner, config) if config.activations else []
        self.activation_names = tuple(name for name, _ in watched_outputs)
        self.alert_engine = AlertEngine(
            config.alerts,
            self.collector.layer_names,
            rank,
            kinds=layer_kinds(self.layers, config.granularity),
            saturating=saturating_layers(inner, self.layers),
        )
        # A rule that may raise is evaluated here, in the training thread, before the
        # optimizer applies the step; otherwise the worker evaluates every rule.
        self._raise_on_alert = "raise" in config.alerts.actions()
        self.step = 0
        # The guard reads its verdict at every step only where that costs no wait for the
        # device (the CPU), or where a raise rule must see every step anyway; under FSDP2
        # each rank sees only its shards, so unlogged steps would need a collective: there
        # the verdict comes with the logged steps.
        self._guard_every_step = self.ranks is None or self.ranks.layout == "replicated"
        self._setup_signals(config, optimizer, scaler, steps)
        self.assembler = Assembler(
            self.collector,
            config,
            self.alert_engine,
            self.activation_names,
            self.ranks,
            drops=self.drops,
            spike_size=0 if self._spikes is None else self._spikes.size,
            mesh=self.mesh,
        )
        self.worker = Worker(
            self.assembler, sinks, self.mailbox, config, on_alert=on_alert, drops=self.drops
        )
        # The first logged step of each layer_every window writes (and computes) every layer.
        self._per_layer_due = layer_schedule(config)
        # So does the first non-finite step of each window, logged or not (the guard's find).
        self._first_bad_due = FirstInWindow(config.layer_every)
        # And the first spiking one, apart: a spike must not take a later NaN's place.
        self._first_spike_due = FirstInWindow(config.layer_every)
        # None: the guard's verdict is read at each step on the CPU, and latched on the
        # device for the next logged step elsewhere (`gradtrack.latch`); False: latched
        # everywhere (how tests take the accelerator's path on a CPU).
        self.guard_reads_host: bool | None = None
        self._latch: BadStepLatch | None = None
        self.collect_errors = 0
        self.closed = False
        self._queued_for_task = -1  # the backward (graph task) whose end is already hooked
        self._handles: list[RemovableHandle] = []
        self._scaler_tap: ScalerTap | None = None
        self._accumulation: AccumulationCheck | None = None
        self._order_probe: BackwardOrderProbe | None = None
        self._activation_probe: ActivationProbe | None = None
        self._output_probe: OutputProbe | None = None
        self._origin_probe: OriginProbe | None = None
        self._local_probe: LocalNormProbe | None = None
        self._warned_no_activations = False
        self._steps = steps
        try:
            self._attach(model, optimizer, scaler, [module for _, module in watched_outputs])
        except BaseException:  # leave the model, the scaler and the threads as they were
            self._detach()
            self.worker.request("stop", config.flush_timeout_s)
            raise
        _WATCHED[inner] = self
        lifecycle.opened(self)

    def _setup_signals(
        self,
        config: GradtrackConfig,
        optimizer: torch.optim.Optimizer | None,
        scaler: torch.amp.GradScaler | None,
        steps: StepSource,
    ) -> None:
        """The every-step spike statistics, the skip rules and the update signals (see
        docs/signals.md): what they need is checked here, at watch time."""
        rules, engine = config.alerts, self.alert_engine
        layer_names = self.collector.layer_names
        columns: list[str | None] = [None, *layer_names]
        skip_rules = rules.skip_rules()
        own_steps = optimizer is not None and scaler is None and steps == "auto"
        if (skip_rules or config.update_signals.enabled) and not own_steps:
            feature = f"action='skip' ({', '.join(skip_rules)})" if skip_rules else "update_signals"
            raise GradtrackError(
                f"{feature} needs optimizer= (without scaler= or steps=): gradtrack must be "
                "at the optimizer's step, before and after it runs. (A GradScaler already "
                "skips non-finite steps by itself.)"
            )
        if config.update_signals.enabled and self.collector.local_shards:
            raise GradtrackError("update_signals does not support sharded (FSDP2) parameters yet")
        spike_on = [engine.rule("spike", layer).enabled for layer in columns]
        self._spikes: NormWindow | None = None
        if any(spike_on) and self._guard_every_step:
            self._spikes = NormWindow(
                len(layer_names), rules.spike.window, rules.spike.warmup,
                z=[engine.rule("spike", layer).z for layer in columns],
                ratio=[engine.rule("spike", layer).ratio for layer in columns],
                enabled=spike_on,
            )  # fmt: skip
        self._skips: SkipPolicy | None = None
        self._journal: Journal | None = None
        self._forwards: ForwardCounter | None = None
        if skip_rules:
            self._skips = SkipPolicy(engine, layer_names, config.skip.max_consecutive)
            self._journal = Journal(config.skip.journal)
        self._layer_norms: LayerNorms | None = None
        if self._spikes is not None or self._skips is not None:
            self._layer_norms = LayerNorms(self.collector.tensor_layer, len(layer_names))
        self._updates: UpdateProbe | None = None
        if config.update_signals.enabled:
            self._updates = UpdateProbe(self.collector.params)
        # A logged step waiting for its optimizer step, to carry the update it applied.
        self._held: PendingStep | AssembledStep | None = None
        self._gate: OptimizerGate | None = None

    def _attach(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scaler: torch.amp.GradScaler | None,
        output_modules: list[nn.Module],
    ) -> None:
        manual = self._steps == "manual"
        if scaler is not None:
            self._scaler_tap = ScalerTap(scaler, None if manual else self._step_boundary)
        elif optimizer is not None and self._skips is not None:
            self._gate = OptimizerGate(optimizer, self._end_step)
            self._forwards = ForwardCounter(model)
            self._handles.append(self._forwards.handle)
        elif optimizer is not None and self._steps == "auto":
            self._handles.append(optimizer.register_step_pre_hook(self._before_optimizer_step))
        elif not manual:
            for param in self.collector.params:
                if param.requires_grad:
                    self._handles.append(param.register_post_accumulate_grad_hook(self._grad_ready))
            if self._steps == "auto":  # one step per backward: tell accumulation apart
                self._accumulation = AccumulationCheck(self.collector.params)
                self._handles.append(self._accumulation.handle)
        self._handles.extend(ReplacementCheck(unwrap_model(model)).handles)
        if self._updates is not None and optimizer is not None:
            self._handles.append(optimizer.register_step_post_hook(self._after_optimizer_step))
        layer_of = {
            id(p): int(i) for p, i in zip(self.collector.params, self.collector.tensor_layer)
        }
        self._order_probe = BackwardOrderProbe(self.collector.params, layer_of)
        # Forward evidence is read only where records are made, but for the output's under
        # sharding: each rank's travels to rank 0 with its rows, naming where a NaN arose.
        records_here = self.ranks is None or self.ranks.rank == 0
        if records_here or self.mesh is not None:
            self._output_probe = OutputProbe(model, self._next_step_is_due)
            self._handles.append(self._output_probe.handle)
        if records_here:
            self._origin_probe = OriginProbe(unwrap_model(model))
        else:
            output_modules = []
        if output_modules:
            self._activation_probe = ActivationProbe(output_modules, self._next_step_is_due)
            self._handles.extend(self._activation_probe.handles)
        if self.ranks is not None and self.ranks.layout == "replicated":
            self._local_probe = LocalNormProbe(self.collector.params, self._next_step_is_due)
            self._handles.extend(self._local_probe.handles)

    def _mesh_reduction(self, ranks: RankGroup) -> MeshReduction:
        """Sharded gradients on any mesh: each rank's local rows, combined across ranks
        (one collective now to find each piece's owner, one per logged step after)."""
        collector = self.collector
        names = [collector.layer_names[i] for i in collector.tensor_layer]
        mesh = MeshReduction.build(
            ranks, list(zip(names, collector.params)), collector.sample_counts
        )
        collector.sample_counts = mesh.local_sample_counts
        collector.reduce_shards = mesh
        return mesh

    def _detach(self) -> None:
        """Remove every hook and wrapper gradtrack added."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._order_probe is not None:
            self._order_probe.remove()
            self._order_probe = None
        if self._scaler_tap is not None:
            self._scaler_tap.remove()
        if self._gate is not None:
            self._gate.remove()
        if self._origin_probe is not None:
            self._origin_probe.remove()

    # -- public state -------------------------------------------------------------------
    @property
    def layer_names(self) -> tuple[str, ...]:
        return self.collector.layer_names

    @property
    def sinks(self) -> list[GradientSink]:
        return self.worker.sinks

    @property
    def dropped_steps(self) -> int:
        """Steps lost to a full queue: the worker's (``queue_full="drop_oldest"``) or a
        sink's (``sink_buffer_steps``). The first loss is warned about; the count is logged
        as ``gradtrack/dropped``."""
        return self.drops.total

    @property
    def host_transfers(self) -> int:
        """Device→host copies made so far: one per logged step and device."""
        return self.collector.host_transfers

    @property
    def sink_errors(self) -> dict[str, int]:
        """Failed calls per sink (each sink's first failure was also warned about)."""
        return {
            f"{i}:{type(sink).__name__}": count
            for i, (sink, count) in enumerate(zip(self.worker.sinks, self.worker.sink_errors))
        }

    # -- hooks (training thread) ----------------------------------------------------------
    def _grad_ready(self, _param: torch.Tensor) -> None:
        # Cheap on purpose: it runs for every parameter on every backward. Keyed by graph
        # task, so a backward that raised before its end cannot block the next one.
        task = torch._C._current_graph_task_id()
        if task != self._queued_for_task:
            self._queued_for_task = task
            if callable(self._steps) and not self._steps():
                return  # e.g. a gradient-accumulation micro-batch
            end = self._step_boundary if self.ranks is None else self._after_reducer
            torch.autograd.Variable._execution_engine.queue_callback(end)

    def _after_reducer(self) -> None:
        # DDP queues its own end-of-backward callback (copying the all-reduced gradients
        # back) after ours was queued; a callback queued now runs after it.
        torch.autograd.Variable._execution_engine.queue_callback(self._step_boundary)

    def _before_optimizer_step(self, *_: Any) -> None:
        self._step_boundary()

    def end_step(self) -> None:
        """End the current step now: gradients are complete (watchers made with
        ``steps="manual"``, as the Lightning and Hugging Face callbacks do)."""
        if self._steps != "manual":
            raise GradtrackError(
                "end_step() is for watchers whose steps are marked by hand (steps='manual'); "
                "this one ends steps by itself"
            )
        if not self.closed:
            self._step_boundary()

    def _next_step_is_due(self) -> bool:
        return self._is_due(self.step) != (False, False)

    def _is_due(self, step: int) -> tuple[bool, bool]:
        hist_every = self.config.hist_every
        return step % self.config.log_every == 0, hist_every is not None and step % hist_every == 0

    def _after_optimizer_step(self, *_: Any) -> None:
        """The update a held logged step applied: measured, attached, handed on."""
        held, self._held = self._held, None
        if held is None or self._updates is None:
            return
        try:
            update = self._updates.after()
            if isinstance(held, PendingStep):
                held.update = update
            else:  # judged already (a raise rule): its record gets the signals now
                record = held.records[-1]
                fields = self.assembler.update_fields(
                    PendingStep(record.step, record.wall_time, [], update=update), record.layers
                )
                held.records[-1] = replace(record, **fields)
        except Exception as exc:  # watching must never crash training
            self._collect_failed(self.step - 1, exc)
        self.mailbox.put_step(held)

    def _release_held(self) -> None:
        """A held step whose optimizer step did not come (skipped, or it raised)."""
        held, self._held = self._held, None
        if held is not None:
            self.mailbox.put_step(held)

    def _hand_on(self, item: PendingStep | AssembledStep, logged: bool, skip: Skip | None) -> None:
        if self._updates is not None and logged and skip is None:
            try:
                self._updates.before()
                self._held = item
                return
            except Exception as exc:  # watching must never crash training
                self._collect_failed(self.step - 1, exc)
        self.mailbox.put_step(item)

    def _step_boundary(self) -> None:
        self._end_step()

    def _end_step(self) -> bool:
        """End step ``self.step``: guard it, judge it, summarise it if due. True: a skip rule
        tripped, and the optimizer step is to be left out."""
        self._release_held()
        step, self.step = self.step, self.step + 1
        if self._accumulation is not None:
            self._accumulation.backward()
        backward_order = self._finish_order_probe()
        micro_batches = self._forwards.take() if self._forwards is not None else []
        logged, with_samples = self._is_due(step)
        guard = self._guard(step, exact=logged or with_samples)
        if guard is None:
            return False
        norms, spike = self._signals(guard, step)
        verdict = self._verdict(guard, norms, spike)
        if verdict is None:
            self._latch_if_bad(guard, step, spike)
        finite, spiked, skip = verdict or (True, False, None)
        bad, flagged = not finite, not finite or spiked
        error: GradientAlertError | None = None
        if skip is not None and self._skips is not None:
            error = self._skips.count(step, skip)
            if error is None and self._journal is not None:
                self._write_journal(step, skip, micro_batches)
            skip = None if error is not None else skip
        first_bad = bad and self._first_bad_due(step)
        first_flagged = first_bad or (spiked and not bad and self._first_spike_due(step))
        origin = None
        if bad and (logged or with_samples or first_bad or self._raise_on_alert or skip):
            origin = self._origin(replay=first_bad or self._raise_on_alert or bool(skip))
        if self._origin_probe is not None:
            self._origin_probe.forget()  # the step's inputs and output gradient
        judged = flagged and (self._raise_on_alert or error is not None)
        if not (logged or with_samples or first_flagged or judged or skip is not None):
            return False  # the common case: one pass over the gradients, nothing handed off
        if not guard.exact:  # a bad or skipped step is summarised: its norms must be exact
            guard = self._guard(step, exact=True) or guard
        due = logged or with_samples
        per_layer = (due and self._per_layer_due(step)) or first_flagged
        pending = self._collect(guard, step, with_samples, backward_order, per_layer, due, spike)
        if pending is not None:
            pending.origin = origin
            pending.skipped_by = None if skip is None else skip.rule
            pending.skipped_steps = 0 if self._skips is None else self._skips.total
        if not self._raise_on_alert:
            if pending is not None:
                self._hand_on(pending, logged, skip)
            if error is not None:
                raise error
            return skip is not None
        error = self._evaluate_now(pending, logged, skip) or error
        if self.ranks is not None:
            # Every rank stops together, or the others would wait in their next collective.
            event = None if error is None else error.event
            shared = self.ranks.broadcast_from_first(
                None if event is None else event.model_dump_json()  # type: ignore[attr-defined]
            )
            if error is None and shared is not None:
                error = GradientAlertError(AlertEvent.model_validate_json(shared))
        if error is not None:
            raise error
        return skip is not None

    def _signals(self, guard: Guard, step: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Every step, on the device: the total and layer norms, and the spike vector."""
        if self._layer_norms is None:
            return None, None
        try:
            norms = self._layer_norms(guard)
            if self._spikes is None:
                return norms, None
            return norms, self._spikes.update(norms, host=on_host(guard))
        except Exception as exc:  # watching must never crash training
            self._collect_failed(step, exc)
            return None, None

    def _write_journal(self, step: int, skip: Skip, micro_batches: list[int]) -> None:
        assert self._journal is not None
        try:
            self._journal.add(step, skip, micro_batches)
        except OSError as exc:  # the step is still skipped; only its journal line is lost
            self._collect_failed(step, exc)

    def _origin(self, replay: bool) -> dict[str, Any] | None:
        """A non-finite step, before its update: are the weights already non-finite (an
        earlier bad update was applied)? If not, and ``replay``, which module made it."""
        try:
            collector = self.collector
            weights = nonfinite_weight_layers(
                collector.layer_names, collector.params, collector.tensor_layer
            )
            fields: dict[str, Any] = {"nonfinite_weights": weights}
            if not weights and replay and self._origin_probe is not None:
                found = self._origin_probe.locate()
                fields.update(
                    origin_module=found.module,
                    origin_module_stage=found.stage,
                    origin_note=found.note,
                )
            return fields
        except Exception as exc:  # watching must never crash training
            self._collect_failed(self.step - 1, exc)
            return None

    def _verdict(
        self, guard: Guard, norms: torch.Tensor | None, spike: torch.Tensor | None
    ) -> tuple[bool, bool, Skip | None] | None:
        """(finite, spiking, the skip a rule asks for), where that is known now without
        waiting for a device (or a raise or skip rule pays one read per step); None: latch
        it instead."""
        if not self._guard_every_step:
            return True, False, None  # (FSDP2: the logged steps' summaries judge)
        judge_now = self._raise_on_alert or self._skips is not None
        cpu = all(part.device.type == "cpu" for part in guard.devices)
        if not judge_now and (self.guard_reads_host is False or not cpu):
            return None
        if norms is None:
            return bool(guard.finite(wait=True)), False, None
        if cpu:  # host memory already: nothing to wait for, nothing to copy
            finite = bool(guard.finite())
            layer_norms = norms.numpy()
            spike_host = None if spike is None else spike.numpy()
        else:  # the one read a raise or skip rule costs: every device's verdict with it
            flags = [torch.isfinite(part.l2).all().to(norms.device) for part in guard.devices]
            parts = [torch.stack(flags).double(), norms, *([] if spike is None else [spike])]
            read = torch.cat(parts).cpu().numpy()
            finite = bool(read[: len(flags)].all())
            layer_norms = read[len(flags) : len(flags) + len(norms)]
            spike_host = None if spike is None else read[len(flags) + len(norms) :]
        spiking = spike_host is not None and bool(spike_fields(spike_host)["spiking"].any())
        skip = None
        if self._skips is not None:
            skip = self._skips.decide(finite, layer_norms, spike_host)
        return finite, spiking, skip

    def _latch_if_bad(self, guard: Guard, step: int, spike: torch.Tensor | None) -> None:
        if self._latch is None:
            spike_size = 0 if self._spikes is None else self._spikes.size
            self._latch = BadStepLatch(len(self.collector.params), spike_size)
            self.assembler.latch_size = self._latch.size  # before any step carries it
        self._latch.update(guard, step, spike)

    def _guard(self, step: int, exact: bool) -> Guard | None:
        """Every step: each gradient's L2 norm, in one batched pass on its device (exact
        where the step is summarised, see `Collector.guard`)."""
        try:
            return self.collector.guard(exact)
        except Exception as exc:  # watching must never crash training
            self._collect_failed(step, exc)
            return None

    def _collect(
        self,
        guard: Guard,
        step: int,
        with_samples: bool,
        backward_order: list[int] | None,
        per_layer: bool,
        with_ranks: bool,
        spike: torch.Tensor | None = None,
    ) -> PendingStep | None:
        """Launch the step's reductions and its copy to the host; None if this rank hands
        nothing to a worker (another rank writes, or collecting failed). Max and mean |g| are
        computed only on ``per_layer`` steps: they cost two more passes over every gradient.
        ``with_ranks``: the replicated ranks' local norms are gathered (the probe takes them
        on due steps only; every rank agrees on a bad step, whose gradients are all-reduced)."""
        try:
            ranks_local = None
            if self._local_probe is not None and self.ranks is not None and with_ranks:
                # The step's one collective: every replicated rank's local norms, to rank 0.
                local = self._local_probe.take(self.collector.params[0].device)
                ranks_local = self.ranks.all_gather(local).reshape(-1)
            if self.ranks is not None and self.ranks.rank != 0 and self.ranks.layout != "sharded":
                return None
            evidence, activation_order = self._evidence(ranks_local)
            if self._spikes is not None:  # (NaN where this step's statistics failed)
                evidence.append(spike if spike is not None else self._no_spike(guard))
            if self._latch is not None:
                evidence.append(self._latch.take(guard.devices[0].device))
            parts = self.collector.collect(guard, with_samples, evidence, full=per_layer)
        except Exception as exc:  # watching must never crash training
            self._collect_failed(step, exc)
            return None
        if not parts or (self.ranks is not None and self.ranks.rank != 0):
            return None  # (sharded: this rank's shard rows went into rank 0's)
        return PendingStep(
            step, time.time(), parts, backward_order, activation_order, per_layer=per_layer
        )

    def _no_spike(self, guard: Guard) -> torch.Tensor:
        assert self._spikes is not None
        size, device = self._spikes.size, guard.devices[0].device
        return torch.full((size,), float("nan"), dtype=torch.float64, device=device)

    def _collect_failed(self, step: int, exc: Exception) -> None:
        self.collect_errors += 1
        if self.collect_errors == 1:
            warn(
                f"gradtrack could not collect step {step}: {exc!r}; training goes on", stacklevel=4
            )

    def _evaluate_now(
        self, pending: PendingStep | None, logged: bool, skip: Skip | None
    ) -> GradientAlertError | None:
        """A "raise" rule must see the step before the optimizer applies it: the record is
        made and judged here (one wait for the device's copy), then handed to the worker.
        Never waits on a sink."""
        if pending is None:
            return None
        assembled = self.assembler.assemble(pending)
        self._hand_on(assembled, logged, skip)
        for event in assembled.events:
            if self.alert_engine.rule(event.rule, event.layer).action == "raise":
                if event.severity != "info":
                    return GradientAlertError(event)
        return None

    def _finish_order_probe(self) -> list[int] | None:
        probe = self._order_probe
        if probe is None or not probe.order:
            return None
        probe.remove()
        self._order_probe = None
        return probe.order

    def _evidence(
        self, ranks_local: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor | None], list[int] | None]:
        """Step flags (None where unknown): output finite, output grad finite, the
        GradScaler's found-inf, scale and next scale, then the activation-gradient norms,
        then ``ranks_local`` (every rank's local tensor norms); and the order in which
        activation gradients arrived."""
        flags: list[torch.Tensor | None] = [None] * 5
        if self._output_probe is not None:
            flags[:2] = self._output_probe.take()
        if self._scaler_tap is not None:
            flags[2:] = self._scaler_tap.evidence() or (None, None, None)
        order = None
        if self._activation_probe is not None:
            norms, order = self._activation_probe.take()
            flags.extend(norms)
            if not order and not self._warned_no_activations:
                self._warned_no_activations = True
                warn(
                    "activations=True saw no activation gradient this step: forward hooks do "
                    "not run inside a graph compiled after gradtrack.watch (compile first, "
                    "then watch), or the step had no backward through the watched modules",
                    stacklevel=4,
                )
        if ranks_local is not None:
            flags.append(ranks_local)
        return flags, order

    # -- lifecycle ----------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every step collected so far has reached the sinks and they flushed."""
        return self.worker.request("flush", timeout_s or self.config.flush_timeout_s)

    def close(self, outcome: Outcome = "FINISHED") -> None:
        """Remove every hook, deliver what is queued, flush and close the sinks. Idempotent.

        ``outcome`` says how training ended: a run gradtrack started in MLflow is marked so
        (FINISHED, FAILED on an exception, KILLED on an interrupt; the context manager and
        the exit hook tell them apart themselves)."""
        if self.closed:
            return
        self.closed = True
        self._detach()
        self._release_held()
        model = self.model_ref()
        if model is not None and _WATCHED.get(model) is self:
            del _WATCHED[model]
        lifecycle.closed(self)
        timeout_s = self.config.flush_timeout_s
        if not self.worker.request("stop", timeout_s, outcome):
            warnings.warn(
                f"gradtrack's sinks did not finish within flush_timeout_s={timeout_s}; "
                + self.worker.sync_hint(),
                RuntimeWarning,
                stacklevel=2,
            )
        self._after_sinks_closed()

    def _after_sinks_closed(self) -> None:
        """In the caller's thread (MLflow's active run is per thread): a run the MLflow sink
        shared with the user's own ``mlflow.*`` calls is ended there too; then one line says
        how to draw the run's report."""
        commands = []
        for sink in self.sinks:
            try:
                end_shared_run = getattr(sink, "end_shared_run", None)
                if end_shared_run is not None:
                    end_shared_run()
                command = getattr(sink, "report_command", lambda: None)()
                if command:
                    commands.append(command)
            except Exception as exc:  # watching must never crash training
                report(f"gradtrack could not finish with {type(sink).__name__}: {exc!r}")
        report_line = f"; its report: {' ; '.join(commands)}" if commands else ""
        logger.info("closed after %d steps%s", self.step, report_line)

    def __enter__(self) -> Watcher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close(outcome_of(exc_type))

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"step {self.step}"
        return f"<gradtrack.Watcher {len(self.layers)} layers, {state}>"


def watcher_of(model: nn.Module) -> Watcher | None:
    return _WATCHED.get(unwrap_model(model))
