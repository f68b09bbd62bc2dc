"""`Watcher`: the lifecycle of watching one model — hooks, step counting, the worker.

Built by `gradtrack.watch`; closing it removes every hook it added and flushes the sinks.
"""

from __future__ import annotations

import atexit
import time
import warnings
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradtrack.collect import Collector
from gradtrack.config import GradtrackConfig
from gradtrack.errors import GradtrackError
from gradtrack.layers import discover_layers
from gradtrack.sinks.base import GradientSink
from gradtrack.worker import Mailbox, PendingStep, Worker

_WATCHED: weakref.WeakKeyDictionary[nn.Module, Watcher] = weakref.WeakKeyDictionary()
_OPEN: weakref.WeakSet[Watcher] = weakref.WeakSet()


class Watcher:
    """Watches one model's gradients until closed. Use it as a context manager or call `close`.

    ``step`` counts optimizer steps when an optimizer is given, else backward passes; a step
    ``s`` is summarised when ``s % log_every == 0`` and sampled when ``s % hist_every == 0``.
    """

    def __init__(
        self,
        model: nn.Module,
        sinks: Sequence[GradientSink],
        config: GradtrackConfig,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        if model in _WATCHED:
            raise GradtrackError(
                f"this {type(model).__name__} is already watched; call gradtrack.unwatch(model) "
                "or close the first watcher before watching it again"
            )
        self.model_ref = weakref.ref(model)
        self.config = config
        self.layers = discover_layers(model, config)
        self.collector = Collector(self.layers, config.hist_sample_size, config.seed)
        self.mailbox = Mailbox(config.queue_size, config.queue_full)
        self.worker = Worker(
            self.collector, sinks, self.mailbox, config.hist_bins, config.max_batch_steps
        )
        self.step = 0
        self.collect_errors = 0
        self.closed = False
        self._queued_for_task = -1  # the backward (graph task) whose end is already hooked
        self._handles: list[RemovableHandle] = []
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._before_optimizer_step))
        else:
            for param in self.collector.params:
                if param.requires_grad:
                    self._handles.append(param.register_post_accumulate_grad_hook(self._grad_ready))
        _WATCHED[model] = self
        _OPEN.add(self)

    # -- public state -------------------------------------------------------------------
    @property
    def layer_names(self) -> tuple[str, ...]:
        return self.collector.layer_names

    @property
    def sinks(self) -> list[GradientSink]:
        return self.worker.sinks

    @property
    def dropped_steps(self) -> int:
        """Steps dropped because the queue was full (``queue_full="drop_oldest"``)."""
        return self.mailbox.dropped

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
            torch.autograd.Variable._execution_engine.queue_callback(self._step_boundary)

    def _before_optimizer_step(self, *_: Any) -> None:
        self._step_boundary()

    def _step_boundary(self) -> None:
        step, self.step = self.step, self.step + 1
        hist_every = self.config.hist_every
        with_samples = hist_every is not None and step % hist_every == 0
        if step % self.config.log_every and not with_samples:
            return
        try:
            parts = self.collector.collect(with_samples)
        except Exception as exc:  # watching must never crash training
            self.collect_errors += 1
            if self.collect_errors == 1:
                warnings.warn(
                    f"gradtrack could not collect step {step}: {exc!r}; training goes on",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return
        if parts:
            self.mailbox.put_step(PendingStep(step, time.time(), parts))

    # -- lifecycle ----------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every step collected so far has reached the sinks and they flushed."""
        return self.worker.request("flush", timeout_s or self.config.flush_timeout_s)

    def close(self) -> None:
        """Remove every hook, deliver what is queued, flush and close the sinks. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        model = self.model_ref()
        if model is not None and _WATCHED.get(model) is self:
            del _WATCHED[model]
        _OPEN.discard(self)
        timeout_s = self.config.flush_timeout_s
        if not self.worker.request("stop", timeout_s):
            warnings.warn(
                f"gradtrack's sinks did not finish within flush_timeout_s={timeout_s}; "
                "steps still queued may be lost",
                RuntimeWarning,
                stacklevel=2,
            )

    def __enter__(self) -> Watcher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"step {self.step}"
        return f"<gradtrack.Watcher {len(self.layers)} layers, {state}>"


def watcher_of(model: nn.Module) -> Watcher | None:
    return _WATCHED.get(model)


@atexit.register
def _close_open_watchers() -> None:
    # A script that never closes its watcher still gets its last steps delivered.
    for watcher in list(_OPEN):
        watcher.close()
