"""`watch` and `unwatch`: the one-line entry points, opening a watcher on chosen sinks, and
what `watch` returns: a `WatcherLike` (what a script may use of a watcher), the `Watcher`, or
`NullWatcher` when gradtrack is switched off.

``GRADTRACK_DISABLED=1`` (or ``enabled=False``) lets a script keep its ``watch`` line in
production: the model gets no hook, no sink is made, no thread starts, nothing is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from gradtrack.capture.collect import ring_size
from gradtrack.capture.distributed import writes_to_sinks
from gradtrack.capture.layers import unwrap_model
from gradtrack.capture.probes import StepSource
from gradtrack.config import ConfigSource, GradtrackConfig, load_config
from gradtrack.errors import GradtrackError
from gradtrack.formats.event import AlertEvent
from gradtrack.lifecycle import Outcome, outcome_of
from gradtrack.log import logger, show_in_terminal
from gradtrack.sinks import Backend, build_sinks
from gradtrack.sinks.base import GradientSink
from gradtrack.watcher import Watcher, watcher_of
from gradtrack.worker.process import spawn_early

if TYPE_CHECKING:
    from typing import Self


def watch(
    model: torch.nn.Module,
    backend: Backend | Sequence[Backend] = "console",
    optimizer: Any = None,
    config: ConfigSource = None,
    *,
    scaler: torch.amp.GradScaler | None = None,
    on_alert: Callable[[AlertEvent], None] | None = None,
    steps: StepSource = "auto",
    **overrides: Any,
) -> WatcherLike:
    """Watch ``model``'s gradients and stream per-layer summaries to ``backend``.

    ``backend`` is a registered name (``"console"``, ``"memory"``, ``"tensorboard"`` …), a
    `GradientSink`, a TensorBoard ``SummaryWriter``, or a list of these. With ``optimizer``
    (a torch optimizer, Accelerate's wrapper of one, a DeepSpeed engine or its optimizer)
    there is one step per real ``optimizer.step()`` (right for gradient accumulation), else
    one per backward. Under DeepSpeed ZeRO 1–3 the ZeRO optimizer is found by itself.
    ``config`` is a `GradtrackConfig`, a dict or a config file; keyword ``overrides``
    (``log_every=1``) win over everything else.
    With a ``scaler`` (`torch.amp.GradScaler`) a step is one ``scaler.update()``: gradients
    are reported unscaled and overflow-skipped steps become ``amp`` events. ``on_alert`` is
    called with every `AlertEvent`, from gradtrack's worker thread. ``steps="manual"`` leaves
    ending each step to you (`Watcher.end_step`, once gradients are complete); a callable makes
    only the backward passes for which it returns True end a step.

    Returns a `Watcher`; switched off (``enabled=False``, ``GRADTRACK_DISABLED=1``), a
    `NullWatcher` that does nothing. Both are a `WatcherLike`.

    >>> model = torch.nn.Linear(3, 1)
    >>> watcher = watch(model, backend="memory", log_every=50)
    >>> watcher.close()
    """
    resolved = load_config(config, overrides)
    if not isinstance(model, torch.nn.Module):
        raise GradtrackError(f"gradtrack.watch needs a torch.nn.Module, not {type(model).__name__}")
    if isinstance(backend, torch.optim.Optimizer):
        raise GradtrackError(
            f"the second argument of gradtrack.watch is the backend, and got a "
            f"{type(backend).__name__}: did you mean gradtrack.watch(model, optimizer=optimizer)?"
        )
    return open_watcher(
        model,
        lambda: backend,
        resolved,
        optimizer=optimizer,
        scaler=scaler,
        on_alert=on_alert,
        steps=steps,
    )


def open_watcher(
    model: torch.nn.Module,
    backend: Callable[[], Backend | Sequence[Backend]],
    config: GradtrackConfig,
    **options: Any,
) -> WatcherLike:
    """Sinks from ``backend()`` where this process writes (see `writes_to_sinks`), then the
    `Watcher`; if that fails, the sinks it would have used are closed. Switched off
    (``enabled=False``), a `NullWatcher`: no sink is made, nothing touches the model."""
    show_in_terminal()
    if not config.enabled:
        logger.info("off (enabled=False or GRADTRACK_DISABLED=1): nothing is watched")
        return NullWatcher(model, config)
    sinks: list[GradientSink] = []
    spawned = None
    try:
        if writes_to_sinks(config):
            spec = backend()
            # A worker process that will run apart starts now: its imports overlap the
            # building of the sinks.
            spawned = spawn_early(spec, config, ring_size(config, model.parameters()))
            sinks = build_sinks(spec, config)
        watcher = Watcher(model, sinks, config, spawned=spawned, **options)
    except BaseException:
        for sink in sinks:
            sink.close()
        if spawned is not None:
            spawned.close()
        raise
    if sinks:
        missing = watcher.judge.signals.missing
        logger.info(
            "watching %d layers of %s, every %d steps, into %s%s",
            len(watcher.layer_names),
            type(unwrap_model(model)).__name__,
            config.log_every,
            ", ".join(type(sink).__name__ for sink in sinks),
            f" ({missing})" if missing else "",
        )
    return watcher


def unwatch(model: torch.nn.Module) -> None:
    """Stop watching ``model``: remove gradtrack's hooks and flush its sinks (no-op if unwatched).

    >>> model = torch.nn.Linear(3, 1)
    >>> _ = watch(model, backend="memory")
    >>> unwatch(model); unwatch(model)
    """
    watcher = watcher_of(model)
    if watcher is not None:
        watcher.close()


class WatcherLike(Protocol):
    """The public surface of what `gradtrack.watch` returns: a `gradtrack.Watcher`, or a
    `NullWatcher` when gradtrack is switched off. Both implement every member (mypy checks
    both; tests/test_off_switch.py that this is every public member of `Watcher`)."""

    config: GradtrackConfig
    closed: bool
    step: int
    guard_reads_host: bool | None

    @property
    def layer_names(self) -> tuple[str, ...]: ...

    @property
    def sinks(self) -> list[GradientSink]: ...

    @property
    def dropped_steps(self) -> int: ...

    @property
    def host_transfers(self) -> int: ...

    @property
    def sink_errors(self) -> dict[str, int]: ...

    def end_step(self) -> None: ...

    def flush(self, timeout_s: float | None = None) -> bool: ...

    def close(self, outcome: Outcome = "FINISHED") -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...


class NullWatcher:
    """A watcher that watches nothing: every member of `WatcherLike` works and does nothing.
    It keeps no reference to the model and touches nothing of it.

    >>> import torch
    >>> watcher = NullWatcher(torch.nn.Linear(2, 1), GradtrackConfig(enabled=False))
    >>> watcher.layer_names, watcher.sinks, watcher.flush()
    ((), [], True)
    >>> watcher.close(); watcher
    <gradtrack.Watcher off (enabled=False), closed>
    """

    def __init__(self, model: nn.Module, config: GradtrackConfig) -> None:
        self.config = config
        self.closed = False
        self.step = 0  # counts `end_step` calls, as a real watcher's steps would
        self.guard_reads_host: bool | None = None

    @property
    def layer_names(self) -> tuple[str, ...]:
        return ()

    @property
    def sinks(self) -> list[GradientSink]:
        return []

    @property
    def dropped_steps(self) -> int:
        return 0

    @property
    def host_transfers(self) -> int:
        return 0

    @property
    def sink_errors(self) -> dict[str, int]:
        return {}

    def end_step(self) -> None:
        if not self.closed:
            self.step += 1

    def flush(self, timeout_s: float | None = None) -> bool:
        return True

    def close(self, outcome: Outcome = "FINISHED") -> None:
        self.closed = True

    def __enter__(self) -> NullWatcher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close(outcome_of(exc_type))

    def __repr__(self) -> str:
        return f"<gradtrack.Watcher off (enabled=False){', closed' if self.closed else ''}>"


if TYPE_CHECKING:  # mypy holds the null watcher to the protocol
    _null: type[WatcherLike] = NullWatcher
