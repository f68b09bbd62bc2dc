"""What a script may use of a watcher (`WatcherLike`), and the watcher `gradtrack.watch`
returns when gradtrack is switched off (`NullWatcher`).

``GRADTRACK_DISABLED=1`` (or ``enabled=False``) lets a script keep its ``watch`` line in
production: the model gets no hook, no sink is made, no thread starts, nothing is written.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from torch import nn

from gradtrack.config import GradtrackConfig
from gradtrack.lifecycle import Outcome, outcome_of
from gradtrack.sinks.base import GradientSink

if TYPE_CHECKING:
    from typing import Self


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
