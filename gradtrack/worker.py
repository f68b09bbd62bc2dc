"""The worker thread: turns collected steps into `StepRecord`s and hands them to the sinks.

Between the training thread and the worker sits a bounded mailbox; the training thread never
waits on a sink, and a failing sink is reported once and never stops the others.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from gradtrack.alerts import AlertEngine, AlertEvent
from gradtrack.collect import Collector
from gradtrack.config import GradtrackConfig
from gradtrack.distributed import RankGroup, rank_layer_norms
from gradtrack.histogram import Histogram, bin_samples
from gradtrack.record import StepRecord, summarise_layers
from gradtrack.sinks.base import GradientSink
from gradtrack.stats import HostPart

logger = logging.getLogger("gradtrack")


@dataclass
class PendingStep:
    """A step as the training thread left it: device work launched, copies in flight."""

    step: int
    wall_time: float
    parts: list[HostPart]
    backward_order: list[int] | None = None  # layer indices, once learnt
    activation_order: list[int] | None = None  # activation modules, as their grads arrived
    # Sinks write its per-layer metrics (``layer_every``), and max/mean |g| were computed.
    per_layer: bool = True
    evaluated: threading.Event | None = None  # set once alert rules have seen the step


class FirstInWindow:
    """True for the first step it is asked about in each window of ``every`` steps.

    >>> first = FirstInWindow(10)
    >>> [step for step in (0, 3, 12, 15, 27) if first(step)]
    [0, 12, 27]
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self._last_window = -1

    def __call__(self, step: int) -> bool:
        window = step // self.every
        if window == self._last_window:
            return False
        self._last_window = window
        return True


@dataclass
class _Control:
    kind: Literal["flush", "stop"]
    done: threading.Event = field(default_factory=threading.Event)


_Item = PendingStep | _Control


class Mailbox:
    """A bounded queue of steps; control messages (flush, stop) never count against the bound."""

    def __init__(self, capacity: int, when_full: Literal["drop_oldest", "block"]) -> None:
        self.capacity = capacity
        self.when_full = when_full
        self.dropped = 0
        self._items: deque[_Item] = deque()
        self._steps = 0
        self._changed = threading.Condition()

    def put_step(self, item: PendingStep, wait_for_room: bool = False) -> None:
        with self._changed:
            if self.when_full == "block" or wait_for_room:
                self._changed.wait_for(lambda: self._steps < self.capacity)
            while self._steps >= self.capacity:
                oldest = next(i for i, x in enumerate(self._items) if isinstance(x, PendingStep))
                del self._items[oldest]
                self._steps -= 1
                self.dropped += 1
            self._items.append(item)
            self._steps += 1
            self._changed.notify_all()

    def put_control(self, item: _Control) -> None:
        with self._changed:
            self._items.append(item)
            self._changed.notify_all()

    def take(self, max_steps: int, gather_s: float = 0.0) -> list[_Item]:
        """Wait for work; return up to ``max_steps`` steps, stopping after a control message.

        Once a step is waiting, wait up to ``gather_s`` more for others to join it (unless a
        control message, a full batch or an urgent step arrives): fewer, larger hand-offs.
        """
        with self._changed:
            self._changed.wait_for(lambda: bool(self._items))
            if gather_s > 0:
                self._changed.wait_for(lambda: self._ready(max_steps), timeout=gather_s)
            taken: list[_Item] = []
            while self._items and len(taken) < max_steps:
                item = self._items.popleft()
                taken.append(item)
                if isinstance(item, _Control):
                    break
                self._steps -= 1
            self._changed.notify_all()
            return taken

    def _ready(self, max_steps: int) -> bool:
        return self._steps >= max_steps or any(
            isinstance(item, _Control) or item.evaluated is not None for item in self._items
        )


class Worker:
    """Owns the sinks; every sink call happens on this thread."""

    def __init__(
        self,
        collector: Collector,
        sinks: Sequence[GradientSink],
        mailbox: Mailbox,
        config: GradtrackConfig,
        alert_engine: AlertEngine,
        on_alert: Callable[[AlertEvent], None] | None = None,
        on_raise: Callable[[AlertEvent], None] | None = None,
        activation_names: Sequence[str] = (),
        ranks: RankGroup | None = None,
    ) -> None:
        self.sinks = list(sinks)
        self.sink_errors = [0] * len(self.sinks)
        self.record_errors = 0
        self.callback_errors = 0
        self.alert_engine = alert_engine
        self._collector = collector
        self._mailbox = mailbox
        self._hist_bins = config.hist_bins
        self._hist_scale = config.hist_scale
        self._max_batch_steps = config.max_batch_steps
        self._gather_s = config.batch_wait_s
        self._on_alert = on_alert
        self._on_raise = on_raise
        self._activation_names = tuple(activation_names)
        self._model_name = config.model_name
        self._layer_metrics = tuple(config.layer_metrics)
        self._first_bad_in_window = FirstInWindow(config.layer_every)
        self._world_size = 0 if ranks is None or ranks.layout != "replicated" else ranks.world_size
        self._gather_ranks = config.distributed.gather_ranks
        self._layer_position = {name: i for i, name in enumerate(collector.layer_names)}
        self._thread = threading.Thread(target=self._run, name="gradtrack-worker", daemon=True)
        self._thread.start()

    def request(self, kind: Literal["flush", "stop"], timeout_s: float) -> bool:
        """Ask the worker to flush (or flush and close) the sinks; False if it took too long."""
        if not self._thread.is_alive():
            return True
        control = _Control(kind)
        self._mailbox.put_control(control)
        done = control.done.wait(timeout_s)
        if done and kind == "stop":
            # Let the thread end (and free its tensors) before the caller goes on: at
            # interpreter exit a worker still tearing down can abort the process.
            self._thread.join(timeout_s)
        return done

    def _run(self) -> None:
        _yield_cpu_to_training()
        while True:
            records: list[StepRecord] = []
            events: list[AlertEvent] = []
            for item in self._mailbox.take(self._max_batch_steps, self._gather_s):
                if isinstance(item, PendingStep):
                    self._process(item, records, events)
                    continue
                self._hand_over(records, events)
                records, events = [], []
                self._deliver("flush")
                if item.kind == "stop":
                    self._deliver("close")
                    item.done.set()
                    return
                item.done.set()
            self._hand_over(records, events)

    def _process(
        self, pending: PendingStep, records: list[StepRecord], events: list[AlertEvent]
    ) -> None:
        try:
            if pending.backward_order is not None:
                names = self._collector.layer_names
                self.alert_engine.set_backward_order([names[i] for i in pending.backward_order])
            record = self.build_record(pending)
            step_events = list(self.alert_engine.evaluate(record))
            if step_events or record.nan_count or record.inf_count:
                record = self._first_bad_in_full(record)
            records.append(record)
            for event in step_events:
                events.append(event)
                self._act(event)
        except Exception as exc:  # a bug here must not stop the worker
            self.record_errors += 1
            if self.record_errors == 1:
                _report(f"gradtrack could not summarise step {pending.step}: {exc!r}")
        finally:
            if pending.evaluated is not None:
                pending.evaluated.set()

    def _first_bad_in_full(self, record: StepRecord) -> StepRecord:
        """The first step in each ``layer_every`` window that was non-finite or raised an
        alert is written with its per-layer metrics (the step to look at). Only the first:
        a model tripping a rule at every step would otherwise write every layer every step."""
        if not self._first_bad_in_window(record.step) or record.per_layer:
            return record
        return replace(record, per_layer=True)

    def _act(self, event: AlertEvent) -> None:
        action = self.alert_engine.rule(event.rule, event.layer).action
        if event.severity == "info":
            action = "log"
        if action == "warn":
            logger.warning("%s", event.message)
            try:
                warnings.warn(event.message, GradientWarning, stacklevel=2)
            except Exception:  # warnings turned into errors must not kill the worker thread
                pass
        elif action == "raise" and self._on_raise is not None:
            self._on_raise(event)
        if self._on_alert is not None:
            try:
                self._on_alert(event)
            except Exception as exc:
                self.callback_errors += 1
                if self.callback_errors == 1:
                    _report(f"gradtrack's on_alert callback failed: {exc!r}")

    def _hand_over(self, records: list[StepRecord], events: list[AlertEvent]) -> None:
        self._deliver("write", records)
        for event in events:
            self._deliver("alert", event)

    def build_record(self, pending: PendingStep) -> StepRecord:
        for part in pending.parts:
            part.wait()
        flags = pending.parts[0].flags()
        collector = self._collector
        index = np.concatenate([part.tensor_index for part in pending.parts])
        layers, stats, total_norm = summarise_layers(
            collector.layer_names,
            collector.tensor_layer[index],
            collector.tensor_numel[index],
            np.concatenate([part.stats() for part in pending.parts]),
        )
        n_activations = len(self._activation_names)
        activation_flags = flags[5 : 5 + n_activations]
        return StepRecord(
            step=pending.step,
            wall_time=pending.wall_time,
            layers=layers,
            stats=stats,
            total_norm=total_norm,
            histograms=self._histograms(pending.parts),
            model_name=self._model_name,
            layer_metrics=self._layer_metrics,
            per_layer=pending.per_layer,
            abs_stats=pending.per_layer,
            **_evidence(flags[:5]),
            **self._activations(activation_flags, pending.activation_order or []),
            **self._ranks(flags[5 + n_activations :], layers),
        )

    def _ranks(self, local_norms: np.ndarray, layers: tuple[str, ...]) -> dict[str, Any]:
        """Replicated ranks' local (pre-all-reduce) gradients: who went non-finite, and with
        ``gather_ranks`` each rank's layer norms."""
        if not self._world_size or len(local_norms) == 0:
            return {}
        collector = self._collector
        per_tensor = local_norms.reshape(self._world_size, -1)
        bad = ~np.isfinite(per_tensor).all(axis=1)
        fields: dict[str, Any] = {"nonfinite_ranks": tuple(np.flatnonzero(bad).tolist())}
        if self._gather_ranks:
            per_layer = rank_layer_norms(
                per_tensor, collector.tensor_layer, len(collector.layer_names)
            )
            position = self._layer_position
            fields["rank_grad_norms"] = per_layer[:, [position[name] for name in layers]]
        return fields

    def _activations(self, norms: np.ndarray, order: list[int]) -> dict[str, Any]:
        if not self._activation_names or len(norms) == 0:
            return {}
        names = self._activation_names
        arrived = set(order)
        observed = {names[i]: float(v) for i, v in enumerate(norms) if i in arrived}
        first_bad = next((names[i] for i in order if not np.isfinite(norms[i])), None)
        return {"activation_grad_norms": observed, "activation_origin": first_bad}

    def _histograms(self, parts: Sequence[HostPart]) -> dict[str, Histogram]:
        per_layer: dict[int, list[np.ndarray]] = {}
        for part in parts:
            if part.sample_counts is None:
                continue
            layer_of = self._collector.tensor_layer[part.tensor_index]
            pieces = np.split(part.samples(), np.cumsum(part.sample_counts)[:-1])
            for layer, piece in zip(layer_of.tolist(), pieces):
                per_layer.setdefault(layer, []).append(piece)
        histograms = {}
        for layer, pieces in sorted(per_layer.items()):
            histogram = bin_samples(np.concatenate(pieces), self._hist_bins, self._hist_scale)
            if histogram is not None:
                histograms[self._collector.layer_names[layer]] = histogram
        return histograms

    def _deliver(self, method: str, *args: Any) -> None:
        if method == "write" and not args[0]:
            return
        for i, sink in enumerate(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as exc:  # one broken sink must not stop the others
                self.sink_errors[i] += 1
                if self.sink_errors[i] == 1:
                    _report(
                        f"gradtrack sink {type(sink).__name__}.{method} failed: {exc!r}; "
                        "training and the other sinks go on, further errors are only counted"
                    )


def _evidence(flags: np.ndarray) -> dict[str, Any]:
    """StepRecord fields from the step flags (see `Watcher._evidence`)."""
    if len(flags) == 0:
        return {}
    output, output_grad, found_inf, scale, scale_after = (
        None if np.isnan(v) else float(v) for v in flags
    )
    return {
        "output_finite": None if output is None else bool(output),
        "output_grad_finite": None if output_grad is None else bool(output_grad),
        "amp_skipped": None if found_inf is None else found_inf > 0,
        "amp_scale": scale,
        "amp_scale_after": scale_after,
    }


def _yield_cpu_to_training() -> None:
    """Lower this thread's scheduling priority: on a busy machine the training threads get
    the cores first and the worker catches up in their gaps (Linux; elsewhere a no-op)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


class GradientWarning(RuntimeWarning):
    """An alert whose rule's action is ``"warn"``."""


def _report(message: str) -> None:
    logger.warning(message)
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    except Exception:  # warnings turned into errors must not kill the worker thread
        pass
