"""The `GradientSink` protocol every backend implements, the `TrackerSink` base class of
sinks delivered from the spool, and the name → factory registry.

No sink is ever called from the training thread: each has a courier thread of its own
(`gradtrack.delivery.courier`) that makes every call to it, in order.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from gradtrack.alerts import AlertEvent
from gradtrack.config import GradtrackConfig
from gradtrack.errors import GradtrackError
from gradtrack.formats.record import StepRecord


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


class TrackerSink:
    """A sink that reaches a tracker which may be away (a server, a database): it is
    delivered from the run's spool by a `gradtrack.delivery.courier.SpooledCourier`, the one place
    that retries, and keeps no backlog of its own.

    The contract: `send` returns once the tracker holds the batch — metrics, tags and any
    file they name — or raises (then the same batch object is sent again, after a backoff,
    until it goes or the run gives up: the sink may skip what it already sent of it).
    Optional parts have defaults here; nothing is probed with ``hasattr``.
    """

    # Items per `send`, at most; while delivery is caught up, items gather for at most
    # ``gather_s`` seconds (an alert at most one) before a smaller batch goes.
    batch_items: int = 256
    gather_s: float = 0.0
    # > 0: records carrying histograms also go to `send_histograms`, this many at a time,
    # or whatever waits after ``histogram_wait_s`` seconds, at flush and at close. Their
    # own cursor in the spool: a file not yet written never holds back the metrics.
    histogram_steps: int = 0
    histogram_wait_s: float = 60.0
    # Longest wait between two tries while the tracker fails.
    retry_max_s: float = 30.0
    # How training ended, set before the courier ends delivery: a run the sink started is
    # marked so (MLflow: FINISHED, FAILED, KILLED).
    outcome: str = "FINISHED"

    def open(self) -> None:
        """Reach the tracker (its SDK imported, the run created) before the first `send`, so
        that the spool records which run its items belong to before any goes out."""

    def send(self, batch: Sequence[StepRecord | AlertEvent]) -> None:
        """Store records and alerts (oldest first) in the tracker; raise if it could not."""
        raise NotImplementedError

    def send_histograms(self, records: Sequence[StepRecord]) -> None:
        """Store these records' histograms (see ``histogram_steps``)."""

    def spool_target(self) -> dict[str, Any]:
        """JSON-safe, secret-free: how `gradtrack sync` reaches the same run again."""
        raise NotImplementedError

    def waiting_helps(self, error: Exception) -> bool:
        """Whether retrying can fix ``error``; False for a refusal (a login, a permission, an
        untrusted certificate): close then does not wait for it and the spool keeps all."""
        return True

    def failure_message(self, error: Exception) -> str:
        """The one warning an outage (or a refusal) gets when it starts."""
        return (
            f"gradtrack cannot reach {type(self).__name__}'s tracker ({error!r}); steps wait "
            "in the run's spool and are retried with backoff"
        )

    def end(self, complete: bool) -> None:
        """Delivery is over: ``complete`` if the tracker has every item. Release resources."""

    def report_command(self) -> str | None:
        """The command that draws this run's report, once closed."""
        return None

    def end_shared_run(self) -> None:
        """After close, in the thread that made the sink (MLflow's active run is per thread)."""

    # -- GradientSink, for a tracker sink used on its own (no courier, no retries) ---------
    def write(self, batch: Sequence[StepRecord]) -> None:
        self.send(batch)

    def alert(self, event: AlertEvent) -> None:
        self.send([event])

    def flush(self) -> None:
        """Nothing to flush: `send` stores before it returns."""

    def close(self) -> None:
        self.end(complete=True)


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
