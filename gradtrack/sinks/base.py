"""The `GradientSink` protocol every backend implements, `SinkBase` (its optional parts
declared with no-op defaults), `TrackerSink` for sinks delivered from the spool, the
name → factory registry, and `RunBook`: what a tracker sink notes about its run once, or only
when it changes (the first non-finite alert, the weakest and strongest layer, the layers in
order of first appearance), which each sink turns into its tracker's own calls.

Which thread calls what: a sink is made on the thread that calls `gradtrack.watch` (or a
registered factory, there); every delivery call — `write`, `alert`, `flush`, `close`, and a
tracker sink's `open`, `send`, `send_histograms`, `end` — comes from the sink's own courier
thread (``gradtrack-<SinkClass>``, `gradtrack.delivery.courier`), one call at a time, in
order; `report_command` and `end_shared_run` come from the thread that closes the watcher.
Neither the training thread nor the worker thread ever calls a sink.
"""

from __future__ import annotations

import difflib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from gradtrack.config import GradtrackConfig
from gradtrack.errors import GradtrackError
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord


@runtime_checkable
class GradientSink(Protocol):
    """Receives logged steps in batches and alert events; flushes and closes at the end.

    Any object with these four methods is a sink (``backend=`` takes it, and so does a
    factory given to `register_sink`). Every call comes from the sink's courier thread
    (``gradtrack-<SinkClass>``), never two at once, in the order gradtrack made them: the
    training and worker threads never wait on a sink. To have the optional parts (the
    run's ``outcome``, `SinkBase.report_command`, `SinkBase.end_shared_run`) called,
    subclass `SinkBase`; a plain object gets their no-op defaults.
    """

    def write(self, batch: Sequence[StepRecord]) -> None:
        """Take one or more steps, oldest first (courier thread)."""

    def alert(self, event: AlertEvent) -> None:
        """Take one alert event, after the batch holding its step (courier thread)."""

    def flush(self) -> None:
        """Send on anything buffered: at `Watcher.flush` and before `close` (courier thread)."""

    def close(self) -> None:
        """Flush and release resources; called once, last (courier thread; if `gradtrack.watch`
        itself fails after making the sink, on the thread that called it)."""


class SinkBase(ABC):
    """The base of every built-in sink: `GradientSink`'s methods, and its optional parts
    declared here with no-op defaults, so that gradtrack calls them without probing.

    - ``outcome`` — how training ended (``"FINISHED"``, ``"FAILED"``, ``"KILLED"``): set by
      the sink's courier thread just before `close` (a `TrackerSink`: before `end`).
    - `report_command` and `end_shared_run` — called by the thread that closes the watcher
      (`Watcher.close`, the ``with`` block's exit, `gradtrack.unwatch`, or the interpreter's
      exit hook), once the close has waited for delivery; if that wait gave up (a tracker
      away for ``flush_timeout_s``), the courier may still be closing the sink meanwhile.

    A plain `GradientSink` that does not derive from this is wrapped in one that does
    (`as_sink_base`), where gradtrack calls it.
    """

    outcome: str = "FINISHED"

    @abstractmethod
    def write(self, batch: Sequence[StepRecord]) -> None:
        """Take one or more steps, oldest first (courier thread)."""

    @abstractmethod
    def alert(self, event: AlertEvent) -> None:
        """Take one alert event, after the batch holding its step (courier thread)."""

    def flush(self) -> None:
        """Send on anything buffered (courier thread). Default: nothing buffered."""
        return None  # a declared no-op

    def close(self) -> None:
        """Flush and release resources; called once, last (courier thread). Default: none."""
        return None  # a declared no-op

    def report_command(self) -> str | None:
        """The command that draws this run's report, logged once the watcher closed (the
        closing thread). Default: None, no report to draw."""
        return None

    def end_shared_run(self) -> None:
        """After close, on the thread that closes the watcher — the one that made the sink
        (MLflow's active run is per thread): end a run shared with the user's own tracker
        calls. Default: nothing to end."""
        return None  # a declared no-op

    def recipe(self) -> dict[str, Any] | None:
        """How a worker process makes this sink again (`gradtrack.sinks.from_recipe`): a
        picklable dict whose ``"backend"`` names the sink, handed to the child through a
        pipe. None (the default): the sink can only live in the training process, and so
        the watch's worker stays a thread there (`gradtrack.worker.process`)."""
        return None

    def adopt(self, target: dict[str, Any]) -> None:
        """The copy a worker process made of this sink moved on (its
        `TrackerSink.spool_target`: the run it started, or ended): bring this one up to
        date for `report_command` and `end_shared_run`, which run here. Default: nothing to
        follow."""
        return None  # a declared no-op


class _PlainSink(SinkBase):
    """A user's `GradientSink` that is not a `SinkBase`: its four methods, the defaults for
    the rest."""

    def __init__(self, sink: GradientSink) -> None:
        self.sink = sink

    def write(self, batch: Sequence[StepRecord]) -> None:
        self.sink.write(batch)

    def alert(self, event: AlertEvent) -> None:
        self.sink.alert(event)

    def flush(self) -> None:
        self.sink.flush()

    def close(self) -> None:
        self.sink.close()

    def __repr__(self) -> str:
        return f"<{type(self.sink).__name__} with SinkBase's defaults>"


def as_sink_base(sink: GradientSink) -> SinkBase:
    """``sink`` itself if it is a `SinkBase`, else ``sink`` with `SinkBase`'s defaults for
    the optional parts.

    >>> from gradtrack.sinks.memory import MemorySink
    >>> sink = MemorySink()
    >>> as_sink_base(sink) is sink
    True
    >>> class Plain:
    ...     def write(self, batch): pass
    ...     def alert(self, event): pass
    ...     def flush(self): pass
    ...     def close(self): pass
    >>> as_sink_base(Plain()).report_command() is None
    True
    """
    return sink if isinstance(sink, SinkBase) else _PlainSink(sink)


class TrackerSink(SinkBase):
    """A sink that reaches a tracker which may be away (a server, a database): it is
    delivered from the run's spool by a `gradtrack.delivery.courier.SpooledCourier`, the one place
    that retries, and keeps no backlog of its own.

    The contract: `send` returns once the tracker holds the batch — metrics, tags and any
    file they name — or raises (then the same batch object is sent again, after a backoff,
    until it goes or the run gives up: the sink may skip what it already sent of it).
    Optional parts have defaults here; nothing is probed with ``hasattr``.

    Threads: made, and `spool_target` first asked, on the thread that calls
    `gradtrack.watch`; `open`, `send`, `send_histograms`, `waiting_helps`,
    `failure_message`, `spool_target` (after each send), `flush` and `end` on its courier
    thread (under ``gradtrack sync``, a thread sync starts for it); `report_command` and
    `end_shared_run` as `SinkBase` says. The courier calls `flush` and `end`, never
    `write`, `alert` or `close`: those are for a tracker sink used on its own.
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
    # Longest wait between two tries while the tracker fails (the courier's backoff).
    retry_max_s: float = 30.0

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


class RunBook:
    """One run's notes, each handed out only when it is new."""

    def __init__(self) -> None:
        self._nonfinite_seen = False
        self._extremes: tuple[str, str] | None = None
        self._layers: dict[str, None] = {}  # layer names in order of first appearance

    def first_nonfinite(self, event: AlertEvent) -> dict[str, int | str]:
        """The first non-finite alert's step, layer and stage, named as the trackers name
        them; empty for any other event, and for every non-finite one after the first."""
        if event.rule != "nonfinite" or self._nonfinite_seen:
            return {}
        self._nonfinite_seen = True
        return {
            "first_nonfinite_step": event.step,
            "first_nonfinite_layer": event.origin_layer or "",
            "first_nonfinite_stage": event.origin_stage or "",
        }

    def extremes(self, record: StepRecord) -> dict[str, str]:
        """The weakest and strongest layer by gradient norm, when they differ from the last
        ones handed out; empty otherwise."""
        extremes = record.extreme_layers()
        names = None if extremes is None else (extremes[0][0], extremes[1][0])
        if names is None or names == self._extremes:
            return {}
        self._extremes = names
        return {"weakest_layer": names[0], "strongest_layer": names[1]}

    def add_layers(self, layers: Iterable[str]) -> bool:
        """Note the layers not seen before; True if there were any."""
        new = [layer for layer in layers if layer not in self._layers]
        self._layers.update(dict.fromkeys(new))
        return bool(new)

    @property
    def layers(self) -> list[str]:
        """Every layer noted so far, in order of first appearance."""
        return list(self._layers)
