"""The worker in a child process (`gradtrack.worker.process`): a watch into MLflow assembles,
judges and delivers its steps in a process of its own, against MLflow's real embedded store
and a real `mlflow server`; and the faults a pair of processes meets — the worker process
killed, the training process killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.delivery.sync import sync
from gradtrack.handoff.mailbox import PendingStep, QueuedStep, UpdateFollowUp
from gradtrack.worker.process import _STRETCH_S, WorkerProcess, _stretch
from gradtrack.worker.thread import Worker
from tests.conftest import Told
from tests.sinks.mlflow_server import MlflowServer

mlflow = pytest.importorskip("mlflow")
REPO = Path(__file__).resolve().parents[1]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, nan_at: int = -1):
    for step in steps:
        optimizer.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        if step == nan_at:
            model[0].weight.grad[0, 0] = float("nan")
        optimizer.step()


def stored_steps(uri: str, run_id: str) -> list[int]:
    history = mlflow.MlflowClient(uri).get_metric_history(run_id, "grad/total_norm")
    return sorted(metric.step for metric in history)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_a_tight_loop_into_mlflow_runs_its_worker_apart_and_stores_every_step(
    tmp_path: Path, spool_in_tmp: Path
) -> None:
    """3,000 steps with no sleep at log_every=1 into the embedded store: the records, rules
    and MLflow's client run in the worker process (no worker or courier thread here), the
    alert of a NaN step is acted on here, and by the end of close() every step is stored
    once, the run FINISHED, the worker process gone and its spool removed."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    alerts: list[tuple[str, int, str]] = []
    watcher = gradtrack.watch(
        model,
        backend="mlflow",
        optimizer=optimizer,
        log_every=1,
        alerts={"nonfinite": {"action": "skip"}},  # (the NaN step leaves the weights as they were)
        skip={"journal": tmp_path / "skipped_steps.json"},  # (not the working directory's)
        mlflow={"tracking_uri": uri},
        on_alert=lambda e: alerts.append((e.rule, e.step, threading.current_thread().name)),
    )
    worker = watcher.worker
    assert isinstance(worker, WorkerProcess) and worker.pid != os.getpid()
    train(model, optimizer, range(3000), nan_at=2000)
    assert alive(worker.pid)
    names = {thread.name for thread in threading.enumerate()}
    assert "gradtrack-worker" not in names and "gradtrack-MlflowSink" not in names
    watcher.close()
    assert not alive(worker.pid)
    run_id = watcher.sinks[0].run_id
    assert stored_steps(uri, run_id) == list(range(3000))  # each once
    assert ("nonfinite", 2000, "gradtrack-listen") in alerts
    assert mlflow.MlflowClient(uri).get_run(run_id).info.status == "FINISHED"
    assert not spool_in_tmp.exists() or not any(spool_in_tmp.iterdir())
    assert watcher.dropped_steps == 0 and watcher.sink_errors == {"0:MlflowSink": 0}


@pytest.mark.slow
def test_past_the_queue_bound_a_worker_process_behind_the_loop_drops_counted_never_silently(
    tmp_path: Path,
) -> None:
    """``delivery.queue_size=20`` at log_every=1: while the worker process starts (MLflow's
    import, the store's creation) a tight loop outruns it by hundreds of steps, the queue in
    this process, the pipe and the child's own queue all fill, and the oldest steps are
    dropped. Every step is stored once or counted as dropped, none lost silently."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    watcher = gradtrack.watch(
        model,
        backend="mlflow",
        optimizer=optimizer,
        log_every=1,
        delivery={"queue_size": 20},
        mlflow={"tracking_uri": uri},
    )
    assert isinstance(watcher.worker, WorkerProcess)
    train(model, optimizer, range(2000))
    watcher.close()
    stored = stored_steps(uri, watcher.sinks[0].run_id)
    assert len(set(stored)) == len(stored) and set(stored) <= set(range(2000))
    assert watcher.dropped_steps > 0
    assert len(stored) + watcher.dropped_steps == 2000
    assert stored[-1] == 1999  # the newest kept


def test_a_raise_rule_is_answered_by_the_worker_process_before_the_update(
    tmp_path: Path,
) -> None:
    """A raise rule's step waits for the worker's judgement; from a worker process the answer
    comes back through the pipe, and the error stops training before the optimizer applies
    the step."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with gradtrack.watch(
        model,
        backend="mlflow",
        optimizer=optimizer,
        alerts={"nonfinite": {"action": "raise"}},
        mlflow={"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    ) as watcher:
        assert isinstance(watcher.worker, WorkerProcess)
        with pytest.raises(gradtrack.GradientAlertError) as raised:
            train(model, optimizer, range(40), nan_at=25)
        assert raised.value.event.step == 25 and raised.value.event.rule == "nonfinite"
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_sinks_that_live_only_here_keep_a_worker_thread(tmp_path: Path) -> None:
    """A memory sink (its records are read in this process) keeps the worker a thread, and so
    does ``delivery.process=False`` with MLflow."""
    model = mlp()
    with gradtrack.watch(model, backend=["memory"]) as watcher:
        assert isinstance(watcher.worker, Worker)
    options = {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    with gradtrack.watch(model, backend="mlflow", mlflow=options, delivery={"process": False}) as w:
        assert isinstance(w.worker, Worker)


def children() -> set[int]:
    """This process's child processes still running or not yet reaped."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # (gone meanwhile)
            continue
        if int(fields[1]) == os.getpid():
            found.add(int(stat.parent.name))
    return found


@pytest.mark.slow
def test_the_worker_process_starts_before_the_sinks_are_built_and_takes_steps_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``backend="mlflow"``: the child that runs the worker is already running while this
    process builds its sinks (MLflow imported, its store opened), so that its own imports
    (torch, gradtrack, MLflow's client) overlap those; it is the watch's worker, and every
    step reaches MLflow."""
    import gradtrack.api

    seen: list[set[int]] = []
    build = gradtrack.api.build_sinks

    def build_after_looking(*args: object) -> object:
        seen.append(children())
        return build(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(gradtrack.api, "build_sinks", build_after_looking)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    before = children()
    with gradtrack.watch(
        model, backend="mlflow", optimizer=optimizer, log_every=1, mlflow={"tracking_uri": uri}
    ) as watcher:
        assert isinstance(watcher.worker, WorkerProcess)
        assert seen and watcher.worker.pid in seen[0] - before
        train(model, optimizer, range(50))
    assert stored_steps(uri, watcher.sinks[0].run_id) == list(range(50))
    assert children() == before


def test_a_worker_process_started_for_a_watch_that_fails_or_stays_here_is_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child started early is ended, not left behind, where the watch fails after it
    started (here: the model is watched already), and where the sinks turn out to be ones
    that live only in this process (a user's own sink registered as "mlflow")."""
    from gradtrack.sinks import MemorySink
    from gradtrack.sinks.base import _REGISTRY

    options = {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    model = mlp()
    before = children()
    with gradtrack.watch(model, backend="memory"):
        with pytest.raises(gradtrack.GradtrackError, match="already watched"):
            gradtrack.watch(model, backend="mlflow", mlflow=options)
        assert children() == before
    monkeypatch.setitem(_REGISTRY, "mlflow", lambda config: MemorySink())
    with gradtrack.watch(mlp(), backend="mlflow") as watcher:
        assert isinstance(watcher.worker, Worker)
        assert children() == before


@pytest.mark.slow
def test_a_worker_process_that_dies_is_told_once_and_sync_delivers_what_it_held(
    tmp_path: Path, spool_in_tmp: Path, told: Told
) -> None:
    """The server is not up yet, so every step waits in the worker process's spool; the worker
    process is killed. Training goes on, the loss is told once, every later step is counted as
    dropped, close returns at once, and ``gradtrack sync`` then delivers the held steps once."""
    server = MlflowServer(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "server")
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    watcher = gradtrack.watch(
        model,
        backend="mlflow",
        optimizer=optimizer,
        flush_timeout_s=3,
        mlflow={"tracking_uri": server.uri, "retry_max_s": 1, "request_timeout_s": 2},
    )
    worker = watcher.worker
    assert isinstance(worker, WorkerProcess)
    train(model, optimizer, range(200))
    assert not watcher.flush(timeout_s=2)  # held: the server is away
    os.kill(worker.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while told.count("worker process stopped") == 0 and time.monotonic() < deadline:
        train(model, optimizer, range(10))
    train(model, optimizer, range(100))
    started = time.monotonic()
    watcher.close()
    assert time.monotonic() - started < 5
    assert told.count("gradtrack's worker process stopped (exit code -9)") == 1
    (held,) = list(spool_in_tmp.iterdir())
    assert any(f"gradtrack sync {held}" in m for m in told.messages)
    logged_after = (watcher.step - 200 + 9) // 10
    assert watcher.dropped_steps == logged_after
    server.start()
    try:
        result = sync(held)
        assert result.left == 0 and not held.exists()
        run_id = result.runs["0-MlflowSink"].split()[2]
        assert stored_steps(server.uri, run_id) == list(range(0, 200, 10))
    finally:
        server.stop()


@pytest.mark.slow
def test_a_training_process_killed_outright_leaves_its_worker_to_deliver_every_step(
    tmp_path: Path, spool_in_tmp: Path
) -> None:
    """SIGKILL (no close, no exit hook) once every step went to the worker process: the worker
    process delivers all 1,500 steps, ends the run KILLED, removes its spool and exits."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = textwrap.dedent(
        f"""
        import os, signal, time, torch, gradtrack
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        watcher = gradtrack.watch(model, backend="mlflow", optimizer=optimizer, log_every=1,
                                  mlflow={{"tracking_uri": {uri!r}}})
        for _ in range(1500):
            optimizer.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            optimizer.step()
        while len(watcher.mailbox):  # every step handed to the worker process
            time.sleep(0.01)
        time.sleep(0.5)
        print(watcher.worker.pid, watcher.sinks[0].run_id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    env = {**os.environ, "GRADTRACK_SPOOL_DIR": str(spool_in_tmp), "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    pid, run_id = result.stdout.split()
    deadline = time.monotonic() + 180
    while alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(int(pid))
    assert stored_steps(uri, run_id) == list(range(1500))  # each once
    assert mlflow.MlflowClient(uri).get_run(run_id).info.status == "KILLED"
    assert not any(spool_in_tmp.iterdir())


def test_the_worker_process_imports_gradtrack_from_where_this_process_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child gets this process's sys.path, whatever its working directory and
    PYTHONPATH: a run started from another folder still has its steps delivered."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with gradtrack.watch(model, backend="mlflow", optimizer=optimizer) as watcher:
        assert isinstance(watcher.worker, WorkerProcess)
        train(model, optimizer, range(20))
        assert watcher.flush(timeout_s=60)  # delivered by its end, the run still open
        assert stored_steps("sqlite:///mlflow.db", watcher.sinks[0].run_id) == [0, 10]


def test_host_copies_cross_the_pipe_exact_whatever_their_dtype_or_layout() -> None:
    """Tensors and arrays go to the worker process as their bytes, dtype and shape (torch's
    own pickling is ~20x slower, numpy's 2x); a view carries only its elements, a dtype numpy
    lacks (bfloat16) goes torch's way, an array of objects numpy's; what arrives is writable
    (the worker fills some in place)."""
    import pickle

    from gradtrack.worker.process import _dumps

    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    tensors = {
        "rows": base,
        "view": base[1:3, ::2],
        "samples": torch.randn(1000, dtype=torch.float32),
        "counts": torch.tensor([1, 2, 3]),
        "bf16": torch.randn(8).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 5),
        "flags": torch.tensor([True, False]),
    }
    message = _dumps(("steps", tensors))
    _, back = pickle.loads(message)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert torch.equal(back[name], tensor), name
    assert len(_dumps(tensors["view"])) < len(_dumps(base))  # not the whole storage

    frozen = np.arange(6.0)
    frozen.flags.writeable = False
    arrays = {
        "evidence": np.array([1.0, np.nan, np.inf]),
        "transposed": np.arange(12).reshape(3, 4).T,
        "frozen": frozen,
        "objects": np.array(["a", None], dtype=object),
        "offsets": np.array([0, 2048, 6144], dtype=np.int64),
    }
    back_arrays = pickle.loads(_dumps(arrays))
    for name, array in arrays.items():
        got = back_arrays[name]
        assert got.dtype == array.dtype and got.shape == array.shape, name
        assert np.array_equal(got, array, equal_nan=name != "objects"), name
        assert got.flags.writeable, name


def test_copies_laid_in_shared_memory_cross_as_where_they_lie_and_their_room_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ring both processes map, both sides in this process: a copy crosses as three
    numbers and is read in place; a full ring lays nothing (the copy is then an ordinary
    tensor); the room of a copy comes back once the reader let it go — or, where it never
    crossed (a step dropped here), once it is let go here — and not before."""
    import pickle

    from gradtrack.handoff import shared as ring
    from gradtrack.worker.process import _dumps

    shared = ring.SharedCopies.create(size=4096)  # four copies of 256 float32
    assert shared is not None
    monkeypatch.setattr(ring, "_attached", ring.SharedCopies(shared.fd, shared.size))
    laid = [shared.empty(256) for _ in range(4)]
    assert all(copy is not None for copy in laid) and shared.empty(256) is None
    for i, copy in enumerate(laid):
        copy.copy_(torch.arange(256, dtype=torch.float32) + 1000 * i)
    message = _dumps(("steps", laid[0]), shared)
    assert len(message) < 200  # (1 KiB of floats: where they lie, not what they are)
    _, there = pickle.loads(message)  # (the reader's view, in place)
    assert torch.equal(there, laid[0]) and there.data_ptr() != laid[0].data_ptr()
    del laid[0]  # (crossed: this side letting it go frees nothing)
    assert shared.empty(256) is None
    del there  # the reader let it go
    assert shared.empty(256) is not None  # (its room, laid again and let go at once)
    del laid[0]  # never crossed: its room comes back here
    fresh = shared.empty(200)
    assert fresh is not None and shared.empty(256) is None
    assert torch.equal(laid[-1], torch.arange(256, dtype=torch.float32) + 3000)  # (untouched)
    assert shared.empty(2000) is None  # (more than a quarter of the ring: never laid)


def test_a_step_reaching_the_worker_process_gives_its_room_in_the_ring_back_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step whose gradients and weights lie in the ring, as it reaches the worker process
    (`_arrived`, what the child does with each step it receives): its copies are reduced to
    the rows the worker would have made of them, and their room comes back while the step
    still waits for the worker — a worker behind the loop holds rows, not the ring."""
    import pickle

    from gradtrack.capture.stats import start_offsets
    from gradtrack.handoff import shared as ring
    from gradtrack.handoff.layout import FlatGrads, FlatUpdate, HostPart
    from gradtrack.worker.process import _arrived, _dumps

    shared = ring.SharedCopies.create(size=4096)  # four copies of 256 float32
    assert shared is not None
    monkeypatch.setattr(ring, "_attached", ring.SharedCopies(shared.fd, shared.size))
    offsets = start_offsets([200, 56])
    torch.manual_seed(0)
    grads, before = torch.randn(256), torch.randn(256)
    after = before - 0.1 * grads
    grads[3] = float("nan")  # (its counts reduced as exactly as its norms)
    copies = [shared.empty(256) for _ in range(3)]
    assert all(copy is not None for copy in copies)
    for copy, values in zip(copies, (grads, before, after)):
        copy.copy_(values)  # type: ignore[union-attr]
    flat = FlatGrads(copies[0], offsets, full=True)
    index = np.arange(2)
    step = PendingStep(7, 0.0, [HostPart(index, None, None, flat=flat)])
    step.update = FlatUpdate(copies[1], copies[2], offsets)  # type: ignore[arg-type]
    message = _dumps(("steps", [(None, step)], 0), shared)
    del step, flat, copies

    def room() -> int:
        """Copies of 256 float32 the ring can lay now (laid, then let go at once)."""
        return sum(copy is not None for copy in [shared.empty(256) for _ in range(4)])

    _, [(_, arrived)], _ = pickle.loads(message)  # (the worker process's side)
    assert room() == 1  # (three held: the step has their views)
    _arrived(arrived)
    assert room() == 4  # the room back, the step not taken by a worker yet
    [part] = arrived.parts
    assert part.flat is None
    expected = FlatGrads(grads.clone(), offsets, full=True).reduce()[0]
    np.testing.assert_array_equal(part.stats(), expected)
    rows, _ = arrived.update
    np.testing.assert_array_equal(rows.numpy(), FlatUpdate(before, after, offsets).rows())


def test_a_process_forked_from_the_trainer_frees_no_room_of_the_ring() -> None:
    """A DataLoader worker forked from the training process inherits its objects and the
    ring's mapping: copies it lets go are not its to free."""
    from gradtrack.handoff.shared import SharedCopies

    shared = SharedCopies.create(size=4096)
    assert shared is not None
    copies = [shared.empty(256) for _ in range(4)]
    pid = os.fork()
    if pid == 0:  # (the forked process)
        copies.clear()
        os._exit(0 if shared.empty(256) is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert shared.empty(256) is None  # (still full here)
    copies.clear()
    assert shared.empty(256) is not None


def test_the_ring_is_sized_for_how_often_copies_go_out_and_made_only_where_used(
    tmp_path: Path,
) -> None:
    """The ring holds as many steps' copies whatever ``log_every`` (or ``histograms.every``,
    where sampled steps come more often) is, within 16-64 MiB: a watch logging every step gets
    four times the default's, whose child would otherwise leave it full between its bursts of
    reading. A model none of whose weights is an fp32 CPU tensor (never copied whole) gets
    none; a large CPU model gets one, since the few layers watched, or a sparse gradient's
    values, may be copied whole."""
    from gradtrack.capture.collect import DEFER_BELOW_ELEMENTS
    from gradtrack.handoff.shared import RING_BYTES, RING_MAX_BYTES

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    large = nn.Sequential(nn.Linear(256, DEFER_BELOW_ELEMENTS // 256 + 1), nn.Linear(257, 2))
    watches: dict[str, tuple[nn.Module, dict[str, Any]]] = {
        "every": (mlp(), {"log_every": 1}),
        "default": (mlp(), {}),
        "sampled": (mlp(), {"log_every": 100, "histograms": {"every": 1}}),
        "fp64": (mlp().double(), {"log_every": 1}),
        "large, its head watched": (large, {"log_every": 1, "include": ["1"]}),
    }
    sizes = {}
    for name, (model, options) in watches.items():
        with gradtrack.watch(model, "mlflow", mlflow={"tracking_uri": uri}, **options) as w:
            assert isinstance(w.worker, WorkerProcess)
            sizes[name] = None if w.worker.shared is None else w.worker.shared.size
    assert sizes == {
        "every": RING_MAX_BYTES,
        "default": RING_BYTES,
        "sampled": RING_MAX_BYTES,
        "fp64": None,
        "large, its head watched": RING_MAX_BYTES,
    }


@pytest.mark.slow
def test_steps_whose_copies_lay_in_shared_memory_or_did_not_are_stored_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ring that holds a few dozen steps, a tight loop at log_every=1 that outruns a child
    still starting: the first steps' copies are laid in shared memory, the rest wait as
    ordinary tensors (reduced before they cross) until the child frees room. Each step's
    total norm and its update ratios (each ``layer_every`` steps) are stored once, exact,
    whichever way it went."""
    from gradtrack.handoff.shared import SharedCopies

    create = SharedCopies.create.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(
        SharedCopies, "create", classmethod(lambda cls, _size: create(cls, 64 << 10))
    )
    laid, full = [], []
    empty = SharedCopies.empty

    def counting(self: SharedCopies, numel: int) -> torch.Tensor | None:
        copy = empty(self, numel)
        (full if copy is None else laid).append(numel)
        return copy

    monkeypatch.setattr(SharedCopies, "empty", counting)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    expected_norms, expected_ratio = [], []
    with gradtrack.watch(
        model, backend="mlflow", optimizer=optimizer, log_every=1, mlflow={"tracking_uri": uri}
    ) as watcher:
        assert isinstance(watcher.worker, WorkerProcess) and watcher.worker.shared is not None
        for _ in range(1500):
            optimizer.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
            expected_norms.append(float(grads.norm()))
            before = torch.cat([p.detach().reshape(-1) for p in model[0].parameters()]).double()
            optimizer.step()
            after = torch.cat([p.detach().reshape(-1) for p in model[0].parameters()]).double()
            expected_ratio.append(float((after - before).norm() / before.norm()))
    assert laid and full  # (both ways taken)
    client = mlflow.MlflowClient(uri)
    run_id = watcher.sinks[0].run_id
    norms = sorted(client.get_metric_history(run_id, "grad/total_norm"), key=lambda m: m.step)
    assert [m.step for m in norms] == list(range(1500))
    np.testing.assert_allclose([m.value for m in norms], expected_norms, rtol=1e-6)
    ratios = sorted(client.get_metric_history(run_id, "update_ratio/0"), key=lambda m: m.step)
    assert [m.step for m in ratios] == list(range(0, 1500, 100))  # (per layer: layer_every)
    np.testing.assert_allclose(
        [m.value for m in ratios], [expected_ratio[m.step] for m in ratios], rtol=1e-5
    )


def _crossing(queue: list[QueuedStep], delay_s: float) -> list[tuple[list[str], int]]:
    """The messages `_stretch` makes of ``queue`` where readying a step takes ``delay_s``:
    each as its items (kind and step) and its count of steps."""

    def outgoing(item: QueuedStep) -> tuple[int | None, QueuedStep]:
        time.sleep(delay_s)
        return None, item

    messages = []
    while queue:
        ready, steps = _stretch(queue, outgoing)
        messages.append(([f"{type(item).__name__} {item.step}" for _, item in ready], steps))
    return messages


def test_the_feed_thread_writes_a_message_each_stretch_of_its_work() -> None:
    """The feed thread readies steps for the pipe in stretches of `_STRETCH_S` (a write
    between two gives the training thread back the GIL): a step slower than that crosses
    alone, quick ones together; the count is of steps, not of the updates that follow one."""

    def queue() -> list[QueuedStep]:
        return [PendingStep(0, time.time(), []), UpdateFollowUp(0), PendingStep(1, time.time(), [])]

    assert _crossing(queue(), _STRETCH_S * 2) == [
        (["PendingStep 0"], 1),
        (["UpdateFollowUp 0"], 0),
        (["PendingStep 1"], 1),
    ]
    quick = _crossing(queue(), 0.0)  # (usually one message; in order and counted in any case)
    assert [item for items, _ in quick for item in items] == [
        "PendingStep 0",
        "UpdateFollowUp 0",
        "PendingStep 1",
    ]
    assert sum(steps for _, steps in quick) == 2
