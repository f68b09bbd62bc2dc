"""The worker in a process of its own, where its Python cannot take the GIL the training
thread needs at every op.

A worker thread shares the training process's GIL: on a short step (a small model, a
launch-bound accelerator loop) its record assembly, rules, histogram binning, spool and the
trackers' clients cost the training loop more than their own time (benchmarks/README.md,
"Where the worker's Python should run"). Where every sink can be made again in a child
(`SinkBase.recipe`: MLflow today), the watch runs its `Worker` there instead
(`WorkerProcess`), and the training process keeps only the two threads that talk to it:

    training thread ── Mailbox ──▶ gradtrack-feed ══ pipe ══▶ child: Mailbox → Worker
                                                                       (records, rules,
    alert actions, replies, ◀── gradtrack-listen ◀══ pipe ══  spool, couriers → tracker)
    delivery state, log lines

The feed thread pickles each step's host copies (tensors as numpy arrays: ~50 µs a step)
and the listen thread wakes only for what the child says back: an alert to act on in the
training process (`AlertActions`: warnings, logging, ``on_alert``), the answer a raise rule
waits for, the sinks' delivery state a few times a second (for flush, close and their
progress lines), and the child's log lines. Skip and raise are still judged on the training
thread, before the optimizer step.

Faults: a child that dies is reported once, with the spool it leaves for ``gradtrack sync``;
steps after it are dropped and counted. A training process killed outright (SIGKILL, the
OOM killer) leaves the child to deliver every step it already holds, end the run as KILLED
and remove its spool. A close that gives up on an unreachable tracker stops the child, so
that its spool is free for ``gradtrack sync`` at once.
"""

from __future__ import annotations

import copyreg
import io
import itertools
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Literal

import numpy as np
import torch

from gradtrack.config import GradtrackConfig
from gradtrack.delivery.courier import (
    DeliveryState,
    sync_hint,
    wait_while_progressing,
    yield_cpu_to_training,
)
from gradtrack.formats.event import AlertEvent
from gradtrack.handoff.layout import FlatUpdate
from gradtrack.handoff.mailbox import (
    Control,
    DropCount,
    Mailbox,
    PendingStep,
    QueuedStep,
    Reply,
    UpdateFollowUp,
)
from gradtrack.handoff.shared import SharedCopies, attach, shared_copy
from gradtrack.lifecycle import Outcome
from gradtrack.log import logger, report
from gradtrack.sinks import made_apart
from gradtrack.sinks.base import GradientSink, as_sink_base
from gradtrack.worker.assemble import AssemblerPlan

_PATH_VARIABLE = "GRADTRACK_WORKER_SYS_PATH"  # the training process's sys.path, for the child
_STATE_EVERY_S = 0.2  # how often the child says how delivery stands, while it changes
_EXIT_WAIT_S = 10.0  # a child that closed its sinks exits within this
_GONE = "gradtrack's worker process has stopped"


def runs_apart(sinks: Sequence[GradientSink], config: GradtrackConfig) -> bool:
    """Whether a watch's worker runs in a child process: `_may_run_apart`, and every sink can
    be made there."""
    return _may_run_apart(config) and all(as_sink_base(sink).recipe() is not None for sink in sinks)


def _may_run_apart(config: GradtrackConfig) -> bool:
    """``delivery.process`` is on, and this is POSIX (the pipes are handed over as file
    descriptors) with an interpreter to start."""
    return config.delivery.process and os.name == "posix" and bool(sys.executable)


@dataclass
class _Setup:
    """The child's first message: what its worker is made of."""

    plan: AssemblerPlan
    recipes: list[dict[str, Any]]


@dataclass
class _Report:
    """How delivery stands in the child: its `DeliveryState`, each tracker sink's target
    (`TrackerSink.spool_target`, for `SinkBase.adopt`), the steps the child itself lost, and
    the steps it took off the pipe (those sent and not yet taken are still to deliver)."""

    state: DeliveryState
    targets: tuple[dict[str, Any] | None, ...]
    dropped: int
    received: int


# -- the training process's side -------------------------------------------------------------
@dataclass
class Spawned:
    """A child started and not yet set up: the process, its two pipes and the ring of copies
    it maps. `spawn_early` starts one before a watch builds its sinks (else the `Watcher`
    does), `WorkerProcess` sets it up; `close` ends one that no watch took."""

    process: subprocess.Popen[bytes]
    to_child: Connection
    from_child: Connection
    shared: SharedCopies | None

    @classmethod
    def start(cls, ring: int) -> Spawned:
        """A child and its ring of ``ring`` bytes (none where 0: see
        `gradtrack.capture.collect.ring_size`), the child importing its worker while it
        waits."""
        shared = SharedCopies.create(ring) if ring else None
        return cls(*_spawn(shared), shared)

    def close(self) -> None:
        """End a child no watch took (it holds nothing yet: no wait for its imports)."""
        for connection in (self.to_child, self.from_child):
            connection.close()
        self.process.terminate()
        self.process.wait()


def spawn_early(backend: object, config: GradtrackConfig, ring: int) -> Spawned | None:
    """The child of a watch that will run its worker apart, started before the watch builds
    its sinks, where ``backend`` names only trackers a child can make (`runs_apart`): its
    imports (torch and gradtrack's worker, ~1.5 s here) overlap the training process's
    building of the sinks (MLflow imported, its store opened: 1–3 s), and it takes steps
    off the pipe about when ``watch()`` returns. (It does not import the tracker's client
    ahead: an import in the child holds up taking its first steps, and steps wait in the
    training process until they are taken.) None where the worker will not run apart, or
    the child could not start (the `Watcher` then starts one, or reports why not). Asked
    only by a process that writes to sinks (`gradtrack.capture.distributed.writes_to_sinks`:
    a coordinated job's rank 0). ``ring``: the bytes of the ring of copies it shares."""
    if not _may_run_apart(config) or not made_apart(backend):
        return None
    try:
        return Spawned.start(ring)
    except OSError:
        return None


class WorkerProcess:
    """The watch's `Worker`, run in a child process, as the training process sees it: the
    same members the `Watcher` uses (`request`, `sinks`, `sink_errors`, `sync_hint`)."""

    def __init__(
        self,
        plan: AssemblerPlan,
        sinks: Sequence[GradientSink],
        mailbox: Mailbox,
        act: Callable[[AlertEvent], None],
        drops: DropCount,
        spawned: Spawned,
    ) -> None:
        self._sinks = list(sinks)
        self._mailbox = mailbox
        self._act = act
        self._drops = drops
        self._delivery = plan.config.delivery  # (its batches: max_batch_steps, batch_wait_s)
        self._plan_spools = plan.config.spool.enabled
        n = len(self._sinks)
        self._state = DeliveryState(0, "", True, (0,) * n, (0,) * n, None)
        self._targets: tuple[dict[str, Any] | None, ...] = (None,) * n
        self._child_dropped = 0
        self._received = 0  # steps the child took off the pipe, as it last said
        self._sent = 0  # steps sent to the child
        self._handed = 0  # of which the child's worker handed to delivery
        self._replies: dict[int, Reply] = {}
        self._controls: dict[int, threading.Event] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stopping = False
        self._gone = threading.Event()  # the child exited (its end of the pipe closed)
        setup = _Setup(plan, [as_sink_base(sink).recipe() or {} for sink in self._sinks])
        # Where the training thread lays a small step's copies, read by the child in place.
        self.shared = spawned.shared
        self._process, self._to_child = spawned.process, spawned.to_child
        self._from_child = spawned.from_child
        self._feeder = threading.Thread(
            target=self._feed, args=(setup,), name="gradtrack-feed", daemon=True
        )
        self._listener = threading.Thread(target=self._listen, name="gradtrack-listen", daemon=True)
        self._feeder.start()
        self._listener.start()

    @property
    def pid(self) -> int:
        """The worker process's id."""
        return self._process.pid

    @property
    def sinks(self) -> list[GradientSink]:
        return self._sinks

    @property
    def sink_errors(self) -> list[int]:
        return list(self._state.sink_errors)

    @property
    def delivery_failures(self) -> list[int]:
        """Per sink, sends that failed and were retried (in the child)."""
        return list(self._state.failures)

    def sync_hint(self) -> str:
        """Where undelivered items wait, and the command that delivers them."""
        return sync_hint(self._state.spool, self._left())

    def request(
        self, kind: Literal["flush", "stop"], timeout_s: float, outcome: Outcome = "FINISHED"
    ) -> bool:
        """As `Worker.request`: the child flushes (or flushes and closes) its sinks; False if
        delivery made no progress for ``timeout_s``. A stop that gave up (or was interrupted)
        ends the child, leaving its spool to ``gradtrack sync``; an interrupted flush leaves it
        delivering."""
        if self._gone.is_set():
            return True  # (its end was reported when it came)
        if kind == "stop":
            self._stopping = True
            for sink in self._sinks:  # how training ended, for end_shared_run here
                as_sink_base(sink).outcome = outcome
        control = Control(kind, outcome)
        names = ", ".join(type(sink).__name__ for sink in self._sinks)
        done = False
        try:
            self._mailbox.put_control(control)
            done = wait_while_progressing(
                control.done,
                self._left,
                timeout_s,
                "delivering to " + names,
                busy=lambda: self._state.starting,
                waiting_for=self._waiting_for,
            )
        except KeyboardInterrupt:
            try:
                if kind == "stop":
                    _spool_before_leaving(self, timeout_s)
            finally:  # (also after a second Ctrl-C, which leaves the rest)
                if self._state.spool is not None:
                    report(f"gradtrack: interrupted while delivering; {self.sync_hint()}")
                if kind == "stop":
                    self._end_child(done=False)
            raise
        if kind == "stop":
            self._end_child(done)
        return done

    def _left(self) -> int:
        return self._not_taken() + self._state.left

    def _not_taken(self) -> int:
        """Steps waiting here or in the pipe: the child has not counted them yet."""
        return len(self._mailbox) + max(0, self._sent - self._received)

    def _waiting_for(self) -> str:
        waiting = self._not_taken()
        told = [f"{waiting:,} step(s) of gradients to hand to the worker process"]
        told = told if waiting else []
        return "; ".join(told + ([self._state.waiting_for] if self._state.waiting_for else []))

    def _end_child(self, done: bool) -> None:
        """After a stop: let the child exit (it does once its sinks closed), or end it where
        delivery gave up, so that its spool is free for ``gradtrack sync`` when close returns."""
        self._stopping = True
        if done:
            try:
                self._process.wait(_EXIT_WAIT_S)
                return
            except subprocess.TimeoutExpired:
                pass
        self._process.terminate()
        try:
            self._process.wait(_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    # -- the feed thread: steps and controls to the child ----------------------------------
    def _feed(self, setup: _Setup) -> None:
        yield_cpu_to_training()
        sending = 0  # steps in the message being sent
        try:
            self._to_child.send(setup)
            while True:
                items = self._mailbox.take(
                    self._delivery.max_batch_steps, self._delivery.batch_wait_s
                )
                if self._mailbox.closed:
                    return
                sending = sum(isinstance(item, PendingStep) for item in items)
                queued = [item for item in items if not isinstance(item, Control)]
                while queued:  # (in messages of `_STRETCH_S` of work each)
                    steps, sent = _stretch(queued, self._outgoing)
                    message = ("steps", steps, self._mailbox.dropped)
                    self._to_child.send_bytes(_dumps(message, self.shared))
                    self._sent += sent
                    sending -= sent
                if items and isinstance(items[-1], Control):
                    control = items[-1]
                    key = next(self._ids)
                    with self._lock:
                        self._controls[key] = control.done
                    self._to_child.send(("control", control.kind, control.outcome, key))
                    if control.kind == "stop":
                        return
        except (OSError, EOFError, ValueError):  # the child is gone: the listen thread tells it
            if sending:
                self._drops.add(sending, _GONE)
        except BaseException as exc:  # a bug must be told, not die silently with the data
            report(f"gradtrack could not hand steps to its worker process: {exc!r}")
            self._process.terminate()

    def _outgoing(self, item: QueuedStep) -> tuple[int | None, QueuedStep]:
        """A step as it crosses (`_host_rows`), its reply kept here (by id)."""
        _host_rows(item, self.shared)
        if isinstance(item, UpdateFollowUp):
            return None, item
        reply, item.reply = item.reply, None
        if reply is None:
            return None, item
        key = next(self._ids)
        with self._lock:
            self._replies[key] = reply
        return key, item

    # -- the listen thread: what the child says back ---------------------------------------
    def _listen(self) -> None:
        yield_cpu_to_training()
        try:
            while True:
                self._take(self._from_child.recv())
        except (OSError, EOFError):
            pass
        except BaseException as exc:
            report(f"gradtrack could not read its worker process's answer: {exc!r}")
            self._process.terminate()
        self._child_gone()

    def _take(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "event":
            self._act(message[1])
        elif kind == "reply":
            _, key, event, judged = message
            with self._lock:
                reply = self._replies.pop(key, None)
            if reply is not None:
                reply.answer(event) if judged else reply.fail()
        elif kind == "state":
            self._follow(message[1])
        elif kind == "done":
            with self._lock:
                done = self._controls.pop(message[1], None)
            if done is not None:
                done.set()
        elif kind == "handed":
            self._handed = message[1]
        elif kind == "log":
            logger.log(message[1], "%s", message[2])

    def _follow(self, told: _Report) -> None:
        self._state, self._received = told.state, told.received
        if told.dropped > self._child_dropped:
            self._drops.count(told.dropped - self._child_dropped)
            self._child_dropped = told.dropped
        for sink, target, before in zip(self._sinks, told.targets, self._targets):
            if target is not None and target != before:
                as_sink_base(sink).adopt(target)
        self._targets = told.targets

    def _child_gone(self) -> None:
        code = self._process.wait()
        self._gone.set()
        if not self._stopping:
            report(
                f"gradtrack's worker process stopped (exit code {code}); steps are no longer "
                f"delivered; {self.sync_hint()}"
            )
        # Steps it took and had not handed to its spool yet, and those still waiting here.
        lost = self._sent - self._handed + len(self._mailbox)
        self._mailbox.close()
        if lost:
            self._drops.add(lost, _GONE)
        with self._lock:
            replies, self._replies = list(self._replies.values()), {}
            controls, self._controls = list(self._controls.values()), {}
        for reply in replies:
            reply.fail()
        for done in controls:
            done.set()


def _spool_before_leaving(worker: WorkerProcess, timeout_s: float) -> None:
    """Ctrl-C while a stop waits on delivery: the steps not yet in the child's spool get there
    before the child is ended (a child still starting, its imports on a busy machine, takes
    seconds, and must not take them with it): those waiting in the training process, being
    sent, in the pipe or in the child's worker (the queue's length read first: a step taken
    meanwhile counts twice, never not at all). Then one more report of the child's state, for
    the sync hint's folder and count. No longer than ``timeout_s`` without progress (a child
    still starting counts as progress), nor once the child is gone; a second Ctrl-C leaves
    them."""
    if worker._gone.is_set() or not worker._plan_spools:
        return

    def unspooled() -> int:
        waiting = len(worker._mailbox)
        return waiting + max(0, worker._mailbox.taken - worker._handed)

    fewest, progress_at = unspooled(), time.monotonic()
    if fewest:
        report(
            f"gradtrack: interrupted; saving {fewest:,} step(s) to the spool first (Ctrl-C "
            "again to leave them)"
        )
    told = None  # the child's last report when the last step reached its spool
    while not worker._gone.wait(0.05):
        left, now = unspooled(), time.monotonic()
        if not left:
            told = worker._state if told is None else told
            if worker._state is not told or now - progress_at > 1.0:  # (each report is new)
                return
        elif left < fewest or worker._state.starting:
            fewest, progress_at = left, now
        elif now - progress_at > timeout_s:
            return


# The feed thread's work between two writes to the pipe, each of which lets the GIL go: the
# longest the training thread, back from an op, waits for it. One message a batch held it for
# all its steps, ~100 us each where the shared ring is full (log_every=1 into MLflow: 2.19x
# the unwatched step, 2.06-2.13x in 500 us messages, 1.96-2.07x one a step); one a step sent
# too slowly for a loaded machine to deliver a SIGKILLed trainer's last steps in time
# (tests/sinks/test_delivery_scale.py).
_STRETCH_S = 500e-6


def _stretch(
    queued: list[QueuedStep], outgoing: Callable[[QueuedStep], tuple[int | None, QueuedStep]]
) -> tuple[list[tuple[int | None, QueuedStep]], int]:
    """The next steps of ``queued`` (taken from it) made ready to cross by ``outgoing``, as
    many as `_STRETCH_S` of work allows, one at least; and how many of them are steps (the
    others: updates that follow a step already handed on)."""
    started = time.perf_counter()
    ready: list[tuple[int | None, QueuedStep]] = []
    while queued and (not ready or time.perf_counter() - started < _STRETCH_S):
        ready.append(outgoing(queued.pop(0)))
    return ready, sum(isinstance(item, PendingStep) for _, item in ready)


def _host_rows(item: QueuedStep, shared: SharedCopies | None) -> None:
    """A step made ready to cross: its host copies complete (no event left to wait on), and
    a small step's copies of its gradients and weights reduced to their rows — a few hundred
    bytes where the copies are tens of KiB: at thousands of steps a second the pickling and
    the pipe would fall behind the loop, and a killed trainer lose more than its last second
    — unless they lie in the memory both processes share (``shared``), where the child
    reduces them as they arrive (``shared`` None: every copy, wherever it lies)."""

    def apart(tensor: torch.Tensor) -> bool:
        return shared is None or not shared.holds(tensor)

    update = item.update
    if isinstance(update, FlatUpdate):
        if apart(update.before) or apart(update.after):
            item.update = torch.from_numpy(update.rows()), None
    elif update is not None:
        rows, ready = update
        if ready is not None:
            ready.synchronize()
        item.update = rows, None
    for part in item.parts if isinstance(item, PendingStep) else []:
        part.wait()
        part.ready = None
        if part.flat is not None and apart(part.flat.values):
            part.stats()


def _arrived(item: QueuedStep) -> None:
    """A step as it reaches the worker process: its copies in the shared ring reduced to their
    rows at once, not when the worker reaches it. A worker behind the loop then holds rows,
    and the copies' room in the ring comes back as they arrive: a full ring has the training
    process reduce its next copies in its feed thread, with the GIL the training thread
    needs (``log_every=1`` on a 0.26 ms step, 2,000-step stretches: 2.17× against 2.39×)."""
    try:
        _host_rows(item, None)
    except Exception:  # (left as it came: the worker's own reading of it reports the fault)
        pass


def _spawn(shared: SharedCopies | None) -> tuple[subprocess.Popen[bytes], Connection, Connection]:
    """Start the child with two pipes of its own (not its stdin or stdout, which stay the
    terminal's: a tracker's SDK may print), and the shared copies' file."""
    to_child_read, to_child = os.pipe()
    from_child, from_child_write = os.pipe()
    copies = () if shared is None else (shared.fd,)
    told = ["-", "0"] if shared is None else [str(shared.fd), str(shared.size)]
    env = {**os.environ, _PATH_VARIABLE: json.dumps(sys.path)}
    code = (
        f"import json, os, sys; sys.path[:] = json.loads(os.environ.pop({_PATH_VARIABLE!r})); "
        "from gradtrack.worker.process import main; main(sys.argv[1:])"
    )
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", code, str(to_child_read), str(from_child_write), *told],
            pass_fds=(to_child_read, from_child_write, *copies),
            stdin=subprocess.DEVNULL,
            env=env,
        )
    except BaseException:
        for fd in (to_child, from_child):
            os.close(fd)
        raise
    finally:
        for fd in (to_child_read, from_child_write, *copies):  # (the mapping stays)
            os.close(fd)
    return process, Connection(to_child, readable=False), Connection(from_child, writable=False)


def _tensor(tensor: torch.Tensor) -> Any:
    """A host tensor as its bytes, dtype and shape (`_array`): twenty times quicker to pickle
    than torch's own way, twice as quick as its numpy array."""
    try:
        values = tensor.detach().cpu().numpy()
    except (TypeError, RuntimeError):  # bfloat16 and the like
        return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return _tensor_of, _array(values)[1]


def _array(array: np.ndarray) -> Any:
    """An array as its bytes (in the stream, no copy made first), dtype and shape: numpy's
    own reduction costs twice the time, paid on a small step's every array at every logged
    step, in the thread that holds the GIL the training thread needs."""
    if array.dtype.hasobject:
        return array.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    return _array_of, (pickle.PickleBuffer(array.data), array.dtype.str, array.shape)


def _array_of(data: bytes | bytearray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """`_array`'s array, as it arrives (writable: the worker may fill it in place)."""
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    return array if array.flags.writeable else array.copy()


def _tensor_of(data: bytes | bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(_array_of(data, dtype, shape))


_DISPATCH: dict[type, Callable[[Any], Any]] = {
    **copyreg.dispatch_table,
    torch.Tensor: _tensor,
    np.ndarray: _array,
}


def _dumps(message: object, shared: SharedCopies | None = None) -> bytes:
    """``message`` pickled, its tensors and arrays as their bytes (`_tensor`, `_array`), or,
    where they lie in ``shared``, as where they lie (`shared_copy`)."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    if shared is None:
        pickler.dispatch_table = _DISPATCH
    else:

        def tensor(tensor: torch.Tensor) -> tuple[Any, ...]:
            place = shared.crossing(tensor)
            return _tensor(tensor) if place is None else (shared_copy, place)

        pickler.dispatch_table = {**_DISPATCH, torch.Tensor: tensor}
    pickler.dump(message)
    return buffer.getvalue()


# -- the child's side ------------------------------------------------------------------------
class _Up:
    """The child's one way back: messages sent whole, from any of its threads."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._lock = threading.Lock()
        self.gone = False  # the training process closed its end: it died

    def __call__(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            if self.gone:
                return
            try:
                self._connection.send(message)
            except OSError:
                self.gone = True


class _ReplyUp(Reply):
    """A raise rule's answer, sent back to the training thread that waits for it."""

    def __init__(self, key: int, up: _Up) -> None:
        super().__init__()
        self._key, self._up = key, up

    def answer(self, event: AlertEvent | None) -> None:
        self._up(("reply", self._key, event, True))

    def fail(self) -> None:
        self._up(("reply", self._key, None, False))


class _LogUp(logging.Handler):
    """The child's gradtrack log lines, logged again in the training process."""

    def __init__(self, up: _Up) -> None:
        super().__init__(logging.INFO)
        self._up = up

    def emit(self, record: logging.LogRecord) -> None:
        self._up(("log", record.levelno, record.getMessage()))


def main(argv: Sequence[str]) -> None:
    """The worker process: ``argv`` holds the two pipes' file descriptors (from, to the
    training process), and the shared copies' file and size (``-`` without). Started early
    (`spawn_early`), it imports its worker before its set-up comes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle
    yield_cpu_to_training()  # (before any thread starts: each inherits it)
    torch.set_num_threads(1)  # the cores are training's
    if argv[2] != "-":
        attach(int(argv[2]), int(argv[3]))
    inbox = Connection(int(argv[0]), writable=False)
    up = _Up(Connection(int(argv[1]), readable=False))
    logger.addHandler(_LogUp(up))
    logger.setLevel(logging.INFO)
    logger.propagate = False
    import gradtrack.worker.thread  # noqa: F401  (the worker's modules, before its set-up)

    try:
        setup = inbox.recv()
    except (EOFError, OSError):  # started early for a watch that did not take it
        return
    child = _Child(setup, up)
    child.serve(inbox)


class _Child:
    """The worker and what talks to it in the child: steps into its mailbox, controls
    answered once done, the delivery state sent up while it changes."""

    def __init__(self, setup: _Setup, up: _Up) -> None:
        # Imported here: the worker and the trackers' sinks load in the child only.
        from gradtrack.sinks import from_recipe
        from gradtrack.worker.thread import Worker

        config = setup.plan.config
        self._up = up
        self.drops = DropCount(report)
        self._elsewhere = 0  # steps the training process's mailbox dropped, counted here too
        self._received = 0  # steps taken off the pipe
        engine = setup.plan.engine()
        assembler = setup.plan.assembler(engine, self.drops)
        sinks = [from_recipe(recipe) for recipe in setup.recipes]
        options = config.delivery
        self.mailbox = Mailbox(options.queue_size, "block", None, options.queue_mib << 20)
        self.worker = Worker(
            assembler,
            sinks,
            self.mailbox,
            config,
            self._event,
            self.drops,
            on_handed=lambda handed: up(("handed", handed)),
        )
        self._patience_s = config.flush_timeout_s
        self._stopped = threading.Event()
        self._told: _Report | None = None
        threading.Thread(target=self._tell, name="gradtrack-state", daemon=True).start()

    def _event(self, event: AlertEvent) -> None:
        self._up(("event", event))

    def serve(self, inbox: Connection) -> None:
        """Take messages until the training process stops the worker, or goes away."""
        while not self._stopped.is_set():
            try:
                message = inbox.recv()
            except (EOFError, OSError):
                self._orphaned()
                break
            if message[0] == "steps":
                self._steps(message[1], message[2])
            else:
                _, kind, outcome, key = message
                self._control(kind, outcome, key)
        self.worker.join()
        self._send_state()

    def _steps(self, steps: list[tuple[int | None, QueuedStep]], dropped_there: int) -> None:
        if dropped_there > self._elsewhere:
            self.drops.count(dropped_there - self._elsewhere)
            self._elsewhere = dropped_there
        for key, item in steps:
            _arrived(item)
            if key is not None and isinstance(item, PendingStep):
                item.reply = _ReplyUp(key, self._up)
            self.mailbox.put_step(item)
            self._received += isinstance(item, PendingStep)

    def _control(self, kind: Literal["flush", "stop"], outcome: Outcome, key: int) -> None:
        control = Control(kind, outcome)
        self.mailbox.put_control(control)

        def answer() -> None:
            control.done.wait()
            self._send_state()
            self._up(("done", key))
            if kind == "stop":
                self._stopped.set()

        threading.Thread(target=answer, name="gradtrack-answer", daemon=True).start()
        if kind == "stop":
            self._stopped.wait()

    def _orphaned(self) -> None:
        """The training process died without closing: deliver everything it handed over,
        then end the run as killed (as ``gradtrack sync`` would)."""
        control = Control("stop", "KILLED")
        self.mailbox.put_control(control)
        self.worker.outbox.wait(control.done, self._patience_s)

    def _tell(self) -> None:
        while not self._stopped.wait(_STATE_EVERY_S):
            self._send_state()

    def _send_state(self) -> None:
        outbox = self.worker.outbox
        try:
            state = outbox.state()
        except Exception:  # the spool was closed: the stop is done, its last state told
            return
        dropped = self.drops.total - self._elsewhere
        told = _Report(state, tuple(outbox.targets()), dropped, self._received)
        if told != self._told:
            self._told = told
            self._up(("state", told))
