"""The `GradientSink` protocol every backend implements, and the name → factory registry.

Sinks are called only from gradtrack's worker thread, never from the training thread.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from gradtrack.alerts import AlertEvent
from gradtrack.config import GradtrackConfig
from gradtrack.errors import GradtrackError
from gradtrack.record import StepRecord


@runtime_checkable
class GradientSink(Protocol):
    """Receives logged steps in batches and alert events; flushes and closes at the end."""

    def write(self, batch: Sequence[StepRecord]) -> None:
        """Take one or more steps, oldest first."""

    def alert(self, event: AlertEvent) -> None:
        """Take one alert event (after the batch holding its step was written)."""

    def flush(self) -> None:
        """Send on anything buffered."""

    def close(self) -> None:
        """Flush and release resources; called once."""


SinkFactory = Callable[[GradtrackConfig], GradientSink]
_REGISTRY: dict[str, SinkFactory] = {}


def register_sink(name: str, factory: SinkFactory) -> None:
    """Make ``backend=name`` build a sink with ``factory(config)``.

    >>> from gradtrack.sinks.memory import MemorySink
    >>> register_sink("notebook", lambda config: MemorySink())
    >>> "notebook" in registered_sinks()
    True
    """
    if not name or not isinstance(name, str):
        raise GradtrackError(f"a sink name must be a non-empty string, not {name!r}")
    _REGISTRY[name] = factory


def registered_sinks() -> list[str]:
    return sorted(_REGISTRY)


def create_sink(name: str, config: GradtrackConfig) -> GradientSink:
    """Build the sink registered as ``name``; an unknown name lists the known ones."""
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, _REGISTRY, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise GradtrackError(
            f"unknown backend {name!r}.{hint} Registered backends: {', '.join(registered_sinks())}"
            " (or pass a GradientSink instance, or add one with gradtrack.register_sink)"
        )
    sink = _REGISTRY[name](config)
    if not isinstance(sink, GradientSink):
        raise GradtrackError(f"the factory registered as {name!r} returned {sink!r}, not a sink")
    return sink
