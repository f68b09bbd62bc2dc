"""`Watcher`: the lifecycle of watching one model — what it is made of, its hooks' entry
points, flush and close.

Built by `gradtrack.watch`; closing it removes every hook it added and flushes the sinks. One
step's data flows one way, through one package per thread: the hooks
(`gradtrack.capture.probes`) end a step, the `Stepper` guards, judges and collects it
(`gradtrack.capture`) and hands it over (`gradtrack.handoff`); the worker assembles it, runs
the rules (`gradtrack.worker`) and delivers it (`gradtrack.delivery`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn

from gradtrack import lifecycle
from gradtrack.capture.collect import Collector, ring_size
from gradtrack.capture.distributed import is_dtensor, rank_group, replicated
from gradtrack.capture.layers import (
    activation_modules,
    discover_layers,
    layer_kinds,
    saturating_layers,
    unwrap_model,
)
from gradtrack.capture.probes import StepSource, hooked_optimizer, scaler_of
from gradtrack.capture.stepper import step_path
from gradtrack.config import GradtrackConfig
from gradtrack.errors import GradtrackError
from gradtrack.formats.event import AlertEvent
from gradtrack.handoff.mailbox import DropCount, Mailbox
from gradtrack.lifecycle import Outcome, outcome_of
from gradtrack.log import logger, report
from gradtrack.sinks import finish_in_caller_thread
from gradtrack.sinks.base import GradientSink
from gradtrack.worker.assemble import AssemblerPlan
from gradtrack.worker.process import Spawned, WorkerProcess, runs_apart
from gradtrack.worker.thread import AlertActions, Worker

AlertCallback = Callable[[AlertEvent], None]

_WATCHED: weakref.WeakKeyDictionary[nn.Module, Watcher] = weakref.WeakKeyDictionary()


class Watcher:
    """Watches one model's gradients until closed. Use it as a context manager or call `close`.

    ``step`` counts ``scaler.update()`` calls when a GradScaler is given, else optimizer steps
    when an optimizer is given, else backward passes; a step ``s`` is summarised when
    ``(s + log_offset) % log_every == 0`` and sampled when ``(s + log_offset) %
    histograms.every == 0``.
    """

    def __init__(
        self,
        model: nn.Module,
        sinks: Sequence[GradientSink],
        config: GradtrackConfig,
        optimizer: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        on_alert: AlertCallback | None = None,
        steps: StepSource = "auto",
        spawned: Spawned | None = None,
    ) -> None:
        """``spawned``: the worker process `gradtrack.worker.process.spawn_early` started for
        these sinks, taken where the worker runs apart, else ended."""
        inner = unwrap_model(model)
        _refuse_watched(inner)
        scaler = scaler or scaler_of(optimizer)  # (Accelerate's fp16 wrapper carries one)
        self.model_ref = weakref.ref(inner)
        self.config = config
        self.layers = discover_layers(inner, config)
        params = [p for layer in self.layers for p in layer.params]
        optimizer, partitions = hooked_optimizer(model, params, optimizer)
        partitioned = partitions is not None
        self.ranks = rank_group(model, params, partitioned) if config.distributed.enabled else None
        if any(is_dtensor(p) for p in params) and optimizer is scaler is None:
            _refuse_sharded_backwards(steps)
        hist = config.histograms
        self.collector = Collector(self.layers, hist.sample_size, hist.seed, self.ranks, partitions)
        self.drops = DropCount(report)
        self.mailbox = Mailbox.for_options(config.delivery, self.drops)
        watched_outputs = activation_modules(inner, config) if config.activations else []
        self.activation_names = tuple(name for name, _ in watched_outputs)
        self.plan = AssemblerPlan(
            self.collector.index,
            config,
            rank=0 if self.ranks is None else self.ranks.rank,
            kinds=layer_kinds(self.layers, config.granularity),
            saturating=saturating_layers(inner, self.layers),
            activation_names=self.activation_names,
            world_size=self.ranks.world_size if replicated(self.ranks) else 0,
            mesh=None if self.collector.mesh is None else self.collector.mesh.places,
        )
        self.alert_engine = self.plan.engine()
        self.collect_errors = 0
        self.closed = False
        self._steps = steps
        self._build_step_path(sinks, on_alert, optimizer is not None, scaler is not None, spawned)
        try:
            outputs = [module for _, module in watched_outputs]
            self.stepper.attach(
                model, params, optimizer, scaler, steps, outputs, self.ranks, config.noise_scale
            )
        except BaseException:  # leave the model, the scaler and the threads as they were
            self.probes.remove()
            self.worker.request("stop", config.flush_timeout_s)
            raise
        _WATCHED[inner] = self
        lifecycle.opened(self)

    def _build_step_path(
        self,
        sinks: Sequence[GradientSink],
        on_alert: AlertCallback | None,
        stepped: bool,
        scaled: bool,
        spawned: Spawned | None,
    ) -> None:
        """The parts a step passes through, from its verdict to the sinks. ``stepped``: an
        optimizer steps once per step; ``scaled``: a GradScaler's update ends each step."""
        config = self.config
        self.stepper = step_path(
            config,
            self.alert_engine.per_step,
            self.collector,
            self.ranks,
            self.mailbox,
            stepped,
            scaled,
            self._collect_failed,
        )
        self.judge, self.probes = self.stepper.judge, self.stepper.probes
        act = AlertActions(self.alert_engine, on_alert).act
        self.worker: Worker | WorkerProcess
        if runs_apart(sinks, config):
            try:
                spawned = spawned or Spawned.start(ring_size(config, self.collector.params))
                self.worker = WorkerProcess(
                    self.plan, sinks, self.mailbox, act, self.drops, spawned
                )
                self.collector.whole.shared = self.worker.shared  # (read there in place)
                return
            except OSError as exc:
                report(f"gradtrack could not start its worker process ({exc!r}); it is a thread")
        if spawned is not None:  # (started early for sinks that turned out to stay here)
            spawned.close()
        assembler = self.plan.assembler(self.alert_engine, self.drops)
        self.worker = Worker(assembler, sinks, self.mailbox, config, act, self.drops)

    # -- public state -------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The next step to end (steps count from 0)."""
        return self.stepper.step

    @step.setter
    def step(self, value: int) -> None:
        self.stepper.step = value

    @property
    def guard_reads_host(self) -> bool | None:
        """None: the guard's verdict is read at each step on the CPU, latched on the device
        for the next logged step elsewhere; False: latched everywhere."""
        return self.judge.reads_host

    @guard_reads_host.setter
    def guard_reads_host(self, value: bool | None) -> None:
        self.judge.reads_host = value

    @property
    def layer_names(self) -> tuple[str, ...]:
        return self.collector.index.layer_names

    @property
    def sinks(self) -> list[GradientSink]:
        return self.worker.sinks

    @property
    def dropped_steps(self) -> int:
        """Steps lost to a full queue: the worker's (``delivery.queue_full="drop_oldest"``)
        or a sink's (``delivery.sink_buffer_steps``). The first loss is warned about; the
        count is logged as ``gradtrack/dropped``."""
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

    # -- the owner's end of a step (training thread) -------------------------------------
    def end_step(self) -> None:
        """End the current step now: gradients are complete (watchers made with
        ``steps="manual"``, as the Lightning and Hugging Face callbacks do)."""
        if self._steps != "manual":
            raise GradtrackError(
                "end_step() is for watchers whose steps are marked by hand (steps='manual'); "
                "this one ends steps by itself"
            )
        if not self.closed:
            self.stepper.boundary()

    def _collect_failed(self, step: int, exc: Exception) -> None:
        self.collect_errors += 1
        if self.collect_errors == 1:
            message = f"gradtrack could not collect step {step}: {exc!r}; training goes on"
            report(message)

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
        self.probes.remove()
        self.stepper.release_held()
        self.stepper.hand_on_last(outcome)
        model = self.model_ref()
        if model is not None and _WATCHED.get(model) is self:
            del _WATCHED[model]
        lifecycle.closed(self)
        timeout_s = self.config.flush_timeout_s
        if not self.worker.request("stop", timeout_s, outcome):
            report(
                f"gradtrack's delivery made no progress for flush_timeout_s={timeout_s:g} s "
                "(a tracker is away); " + self.worker.sync_hint()
            )
        self._after_sinks_closed()

    def _after_sinks_closed(self) -> None:
        commands = finish_in_caller_thread(self.sinks)
        report_line = f"; its report: {' ; '.join(commands)}" if commands else ""
        logger.info("closed after %d steps%s", self.stepper.ended, report_line)

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


def _refuse_watched(model: nn.Module) -> None:
    if model in _WATCHED:
        raise GradtrackError(
            f"this {type(model).__name__} is already watched; call gradtrack.unwatch(model) "
            "or close the first watcher before watching it again"
        )


def _refuse_sharded_backwards(steps: StepSource) -> None:
    if steps != "manual":
        raise GradtrackError(
            "watching a sharded (FSDP2) model needs optimizer= (or scaler=, or "
            "steps='manual'): its gradients are complete only once backward has "
            "reduce-scattered them"
        )


def watcher_of(model: nn.Module) -> Watcher | None:
    return _WATCHED.get(unwrap_model(model))
