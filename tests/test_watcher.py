"""The Watcher's lifecycle and step semantics, on real models and real training loops."""

from __future__ import annotations

import copy
import functools
import inspect
import io
import threading
import time
import warnings
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.capture.probes import BackwardOrderProbe
from gradtrack.formats.metrics import scalar_metrics
from gradtrack.formats.record import StepRecord
from gradtrack.sinks import MemorySink
from tests.conftest import SmallCNN, Told, assert_record_matches, cnn_batch, reference_stats


def train(model: nn.Module, steps: int, optimizer: torch.optim.Optimizer) -> list[float]:
    losses = []
    for step in range(steps):
        images, labels = cnn_batch(seed=step)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def hook_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[object]:
    state: list[object] = [dict(optimizer._optimizer_step_pre_hooks)]
    for p in model.parameters():
        state.append(dict(p._post_accumulate_grad_hooks or {}))
        state.append(dict(p._backward_hooks or {}))
    for m in model.modules():
        state += [dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks)]
        state.append(m.__dict__.get("forward"))
    return state


def test_one_record_per_optimizer_step_with_the_default_schedule(cnn: nn.Module) -> None:
    sink = MemorySink()
    optimizer = torch.optim.SGD(cnn.parameters(), lr=0.01)
    with gradtrack.watch(cnn, backend=sink, optimizer=optimizer) as watcher:
        train(cnn, 25, optimizer)
    assert watcher.step == 25
    assert [r.step for r in sink.records] == [0, 10, 20]  # log_every=10 by default
    assert list(sink.histograms()) == ["0", "3", "7"]
    assert [step for step, _ in sink.histograms()["7"]] == [0]  # histograms.every=100


def test_without_optimizer_one_record_per_backward() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    sink = MemorySink()
    with gradtrack.watch(model, backend=sink, log_every=4, histograms={"every": 6}):
        for _ in range(13):
            model(torch.randn(3, 4)).sum().backward()
    assert [r.step for r in sink.records] == [0, 4, 6, 8, 12]
    assert [step for step, _ in sink.histograms()["0"]] == [0, 6, 12]


def test_gradient_accumulation_summarises_the_accumulated_gradient(cnn: nn.Module) -> None:
    sink = MemorySink()
    optimizer = torch.optim.SGD(cnn.parameters(), lr=0.01)
    expected = []
    with gradtrack.watch(cnn, backend=sink, optimizer=optimizer, log_every=1):
        for step in range(3):
            optimizer.zero_grad()
            for micro in range(4):
                images, labels = cnn_batch(batch_size=4, seed=10 * step + micro)
                (nn.functional.cross_entropy(cnn(images), labels) / 4).backward()
            modules = dict(cnn.named_modules())
            expected.append(
                {
                    n: reference_stats(p.grad for p in modules[n].parameters())
                    for n in ("0", "3", "7")
                }
            )
            optimizer.step()
    assert [r.step for r in sink.records] == [0, 1, 2]
    for record, reference in zip(sink.records, expected):
        assert_record_matches(record, reference, rtol=1e-5)


def test_watching_never_changes_training() -> None:
    def run(watched: bool) -> tuple[list[float], list[torch.Tensor], torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(SmallCNN(), nn.Dropout(0.3))  # dropout consumes the global RNG
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        watcher = None
        if watched:
            watcher = gradtrack.watch(
                model,
                backend=MemorySink(),
                optimizer=optimizer,
                log_every=1,
                histograms={"every": 1},
            )
        losses = train(model, 20, optimizer)
        if watcher is not None:
            watcher.close()
        return losses, [p.detach().clone() for p in model.parameters()], torch.get_rng_state()

    plain, watched = run(False), run(True)
    assert plain[0] == watched[0]
    assert all(torch.equal(a, b) for a, b in zip(plain[1], watched[1]))
    assert torch.equal(plain[2], watched[2])


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_close_removes_every_hook_and_is_idempotent(cnn: nn.Module, with_optimizer: bool) -> None:
    optimizer = torch.optim.SGD(cnn.parameters(), lr=0.01)
    before = hook_state(cnn, optimizer)
    sink = MemorySink()
    watcher = gradtrack.watch(
        cnn, backend=sink, optimizer=optimizer if with_optimizer else None, log_every=1
    )
    assert hook_state(cnn, optimizer) != before
    train(cnn, 2, optimizer)
    watcher.close()
    watcher.close()
    assert hook_state(cnn, optimizer) == before
    assert sink.closed and len(sink.records) == 2
    train(cnn, 2, optimizer)  # nothing more is recorded, nothing raises
    assert len(sink.records) == 2


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"log_every": 1},
        {"log_every": 1, "activations": True},
        {"log_every": 1, "alerts": {"nonfinite": {"action": "skip"}}},
    ],
    ids=["defaults", "every-step", "activations", "skip"],
)
def test_a_watched_forward_keeps_its_signature_and_a_copy_or_a_saved_model_runs_its_own(
    cnn: nn.Module, options: dict[str, object]
) -> None:
    """Hugging Face's Trainer picks a dataset's columns from ``inspect.signature(model.forward)``;
    an EMA of the model is its ``copy.deepcopy``, taken before training or during it; a
    checkpoint may be the whole model, ``torch.save(model)``."""
    signature = inspect.signature(cnn.forward)
    optimizer = torch.optim.SGD(cnn.parameters(), lr=0.05)
    sink = MemorySink()
    with gradtrack.watch(cnn, backend=sink, optimizer=optimizer, **options):
        assert inspect.signature(cnn.forward) == signature
        copies = [copy.deepcopy(cnn)]
        train(cnn, 2, optimizer)
        copies.append(copy.deepcopy(cnn))
        saved = io.BytesIO()
        torch.save(cnn, saved)
        saved.seek(0)
        copies.append(torch.load(saved, weights_only=False))
        images, _ = cnn_batch(seed=9)
        for ema in copies:
            plain = SmallCNN()
            plain.load_state_dict(ema.state_dict())
            assert torch.equal(ema(images), plain(images))  # its own weights, not the model's
        train(cnn, 2, optimizer)
    assert [r.step for r in sink.records] == ([0] if not options else [0, 1, 2, 3])
    assert all(r.output_grad_norm is not None for r in sink.records)


def test_a_data_parallel_replica_runs_its_own_forward_replicated_by_hand() -> None:
    """nn.DataParallel on several GPUs makes each GPU's replica of a module from the module's
    attributes (`torch.nn.parallel.replicate`: it needs the GPUs, so its per-module step is
    called here by hand, as it calls it) and gives the replica that GPU's copy of each weight:
    the replica must run its own forward on them, not the watched module's."""
    model = nn.Linear(4, 2)
    with gradtrack.watch(model, backend=MemorySink(), log_every=1):
        replica = model._replicate_for_data_parallel()
        replica.weight, replica.bias = torch.zeros(2, 4), torch.ones(2)  # (this GPU's copies)
        assert torch.equal(replica(torch.randn(3, 4)), torch.ones(3, 2))
        model(torch.randn(3, 4)).sum().backward()  # the watched module itself stays watched
    assert "forward" not in replica.__dict__


def test_what_reads_or_copies_a_watched_models_forward_finds_the_models_own() -> None:
    """``torch.export`` reads ``model.forward``'s code; a shallow copy (Accelerate's regional
    compilation makes one of the root) carries the module's attributes: neither may find
    gradtrack there (a wrapper of ``forward`` was tried, and failed both)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    with gradtrack.watch(model, backend=MemorySink(), log_every=1):
        exported = torch.export.export(model, (x,))
        assert torch.equal(exported.module()(x), model(x))
        shallow = copy.copy(model)
        shallow._modules = dict(model._modules)
        shallow._modules["2"] = nn.Linear(8, 2)
        assert torch.equal(shallow(x), shallow[2](model[1](model[0](x))))


def _wrap_forward(module: nn.Module, calls: list[str], name: str) -> object:
    """Another library's wrapper of ``module``'s forward (as Accelerate's hooks wrap it)."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: object, **kwargs: object) -> object:
        calls.append(name)
        return inner(*args, **kwargs)

    module.forward = forward  # type: ignore[method-assign]
    return forward


def test_a_forward_another_library_wrapped_before_or_after_the_watch_stays_wrapped() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    calls: list[str] = []
    theirs = _wrap_forward(model, calls, "before")
    first, sink = MemorySink(), MemorySink()
    with gradtrack.watch(model, backend=first, log_every=1):
        model(torch.randn(2, 4)).sum().backward()
    assert model.forward is theirs and calls == ["before"]  # put back as it was
    assert first.records[0].output_grad_norm is not None
    watcher = gradtrack.watch(model, backend=sink, log_every=1)
    later = _wrap_forward(model, calls, "after")
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
    watcher.close()
    assert model.forward is later  # left in place: gradtrack took only its own hooks off
    model(torch.randn(2, 4)).sum().backward()
    assert calls == ["before", "after", "before", "after", "before", "after", "before"]
    assert [r.step for r in sink.records] == [0, 1]
    assert all(r.output_grad_norm is not None for r in sink.records)


def test_watching_twice_is_an_error_until_unwatched(cnn: nn.Module) -> None:
    first = gradtrack.watch(cnn, backend="memory")
    with pytest.raises(gradtrack.GradtrackError, match="already watched"):
        gradtrack.watch(cnn, backend="memory")
    gradtrack.unwatch(cnn)
    assert first.closed
    gradtrack.unwatch(cnn)  # no-op
    gradtrack.watch(cnn, backend="memory").close()


def test_parameter_unfrozen_later_is_picked_up() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    model[0].requires_grad_(False)
    sink = MemorySink()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, log_every=1):
        for step in range(4):
            if step == 2:
                model[0].requires_grad_(True)
            optimizer.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            optimizer.step()
    assert [r.layers for r in sink.records] == [("2",), ("2",), ("0", "2"), ("0", "2")]


def test_a_layer_frozen_and_unfrozen_again_with_its_gradient_kept_comes_and_goes() -> None:
    # zero_grad(set_to_none=False) leaves a frozen layer's gradient in place: only its
    # requires_grad tells the layouts apart, and the second frozen span must not reuse the
    # plan of the steps just before it.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    sink = MemorySink()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, log_every=1):
        for step in range(8):
            model[0].requires_grad_(step not in (2, 3, 6))
            optimizer.zero_grad(set_to_none=False)
            model(torch.randn(8, 4)).pow(2).mean().backward()
            optimizer.step()
    both, last = ("0", "2"), ("2",)
    assert [r.layers for r in sink.records] == [both, both, last, last, both, both, last, both]


class FailingSink:
    def __init__(self) -> None:
        self.calls = 0

    def write(self, batch: Sequence[StepRecord]) -> None:
        self.calls += 1
        raise ConnectionError("tracker is down")

    def alert(self, event: gradtrack.AlertEvent) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_failing_sink_is_reported_once_and_the_others_go_on(cnn: nn.Module, told: Told) -> None:
    failing, memory = FailingSink(), MemorySink()
    optimizer = torch.optim.SGD(cnn.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradtrack.watch(cnn, backend=[failing, memory], optimizer=optimizer, log_every=1) as w:
            for _ in range(5):
                train(cnn, 1, optimizer)
                w.flush()  # one write per step, so the sink fails five times
    assert told.count("tracker is down") == 1  # told once: one log line,
    assert not [c for c in caught if "tracker is down" in str(c.message)]  # no warning too
    assert failing.calls == 5
    assert w.sink_errors == {"0:FailingSink": 5, "1:MemorySink": 0}
    assert [r.step for r in memory.records] == [0, 1, 2, 3, 4]


class SlowSink(MemorySink):
    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.thread_names: set[str] = set()

    def write(self, batch: Sequence[StepRecord]) -> None:
        self.thread_names.add(threading.current_thread().name)
        time.sleep(self.delay_s)
        super().write(batch)


@pytest.mark.slow
def test_a_slow_sink_holds_up_only_its_own_delivery_thread() -> None:
    """A tracker 50 ms per write, a loop as fast as it runs: nothing lost at the defaults,
    and the training thread and the worker never wait on it."""
    model = nn.Linear(8, 1)
    slow, quick = SlowSink(delay_s=0.05), MemorySink()
    with gradtrack.watch(
        model,
        backend=[slow, quick],
        log_every=1,
        delivery={"max_batch_steps": 1},
        histograms=False,
    ) as watcher:
        start = time.perf_counter()
        for _ in range(40):
            model(torch.randn(2, 8)).sum().backward()
        watcher.flush()
        quick_done = len(quick.records)
        trained_s = time.perf_counter() - start
    assert watcher.dropped_steps == 0
    assert [r.step for r in slow.records] == list(range(40))
    assert quick_done == 40
    assert slow.thread_names == {"gradtrack-SlowSink"}  # its courier, not the worker
    assert trained_s < 40 * 0.05 + 30  # (a bound only against hanging, not a timing test)


def test_a_sink_past_its_buffer_drops_the_oldest_counts_and_warns_once(told: Told) -> None:
    model = nn.Linear(8, 1)
    slow = SlowSink(delay_s=0.05)
    with gradtrack.watch(
        model, backend=slow, log_every=1,
        delivery={"sink_buffer_steps": 2, "max_batch_steps": 1}, histograms=False,
    ) as watcher:  # fmt: skip
        for _ in range(40):
            model(torch.randn(2, 8)).sum().backward()
    assert told.count("SlowSink is 2 steps behind") == 1
    assert told.count("dropped") == 1
    steps = [r.step for r in slow.records]
    assert watcher.dropped_steps > 0
    assert len(steps) + watcher.dropped_steps == 40
    assert steps == sorted(steps) and steps[-1] == 39  # the newest survive, in order
    # The count travels with the records: gradtrack/dropped, once non-zero.
    assert slow.records[-1].dropped_steps > 0
    assert "gradtrack/dropped" in scalar_metrics(slow.records[-1])


def test_a_worker_behind_the_loop_drops_counts_and_warns(told: Told) -> None:
    model = nn.Linear(8, 1)
    sink = MemorySink()
    with gradtrack.watch(
        model,
        backend=sink,
        log_every=1,
        delivery={"queue_size": 1, "batch_wait_s": 0.2},
        histograms=False,
    ) as watcher:
        for _ in range(200):
            model(torch.randn(2, 8)).sum().backward()
    assert told.count("worker is 1 steps behind") == 1
    assert watcher.dropped_steps > 0
    assert len(sink.records) + watcher.dropped_steps == 200


def test_full_queue_can_block_instead_and_then_loses_nothing() -> None:
    model = nn.Linear(8, 1)
    slow = SlowSink(delay_s=0.01)
    with gradtrack.watch(
        model,
        backend=slow,
        log_every=1,
        delivery={"queue_size": 2, "queue_full": "block"},
        histograms=False,
    ) as watcher:
        for _ in range(30):
            model(torch.randn(2, 8)).sum().backward()
    assert watcher.dropped_steps == 0
    assert [r.step for r in slow.records] == list(range(30))


def test_histograms_hold_the_sample_and_increasing_edges(cnn: nn.Module) -> None:
    sink = MemorySink()
    optimizer = torch.optim.SGD(cnn.parameters(), lr=0.01)
    with gradtrack.watch(
        cnn, backend=sink, optimizer=optimizer, log_every=1,
        histograms={"every": 1, "sample_size": 1000, "bins": 32},
    ):  # fmt: skip
        train(cnn, 2, optimizer)
    for layer, numel in {"0": 448, "3": 4640, "7": 20490}.items():
        for _, histogram in sink.histograms()[layer]:
            assert len(histogram.counts) == 32 and len(histogram.edges) == 33
            assert np.all(np.diff(histogram.edges) > 0)
            assert histogram.sample_size == min(numel, 1000)


def test_nonfinite_samples_never_reach_the_bins() -> None:
    model = nn.Linear(10, 1, bias=False)
    sink = MemorySink()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with gradtrack.watch(
        model, backend=sink, optimizer=optimizer, log_every=1, histograms={"every": 1}
    ):
        model(torch.ones(1, 10)).sum().backward()
        model.weight.grad[0, :3] = float("nan")
        model.weight.grad[0, 3] = float("inf")
        optimizer.step()
    ((_, histogram),) = sink.histograms()["root"]
    assert histogram.sample_size == 6
    assert np.isfinite(histogram.edges).all()


def test_watch_rejects_models_without_trainable_parameters() -> None:
    model = nn.Linear(3, 3).requires_grad_(False)
    with pytest.raises(gradtrack.GradtrackError, match="no trainable parameters"):
        gradtrack.watch(model)
    with pytest.raises(gradtrack.GradtrackError, match="no trainable parameters"):
        gradtrack.watch(nn.ReLU())


def test_watch_rejects_what_is_not_a_module() -> None:
    with pytest.raises(gradtrack.GradtrackError, match=r"torch\.nn\.Module"):
        gradtrack.watch(lambda x: x)  # type: ignore[arg-type]


def test_a_sink_error_quoting_its_uri_is_reported_without_the_password(told: Told) -> None:
    class LeakySink(FailingSink):
        def write(self, batch: Sequence[StepRecord]) -> None:
            raise ConnectionError("cannot reach http://alice:hunter2@tracker.example/api")

    model = nn.Linear(3, 1)
    with gradtrack.watch(model, backend=LeakySink(), log_every=1) as watcher:
        model(torch.randn(2, 3)).sum().backward()
        watcher.flush()
    messages = told.messages
    assert any("http://***@tracker.example" in m for m in messages)
    assert not any("hunter2" in m for m in messages)


def test_an_optimizer_given_as_the_backend_asks_for_optimizer_keyword(cnn: nn.Module) -> None:
    optimizer = torch.optim.Adam(cnn.parameters())
    with pytest.raises(gradtrack.GradtrackError, match=r"Adam: did you mean .*optimizer=optim"):
        gradtrack.watch(cnn, optimizer)  # type: ignore[arg-type]
    gradtrack.watch(cnn, optimizer=optimizer, backend="memory").close()  # nothing left behind


def test_accumulation_without_optimizer_is_warned_once(cnn: nn.Module) -> None:
    optimizer = torch.optim.SGD(cnn.parameters(), lr=0.01)
    with pytest.warns(RuntimeWarning, match=r"4 backward passes before this SGD.step\(\)") as seen:
        with gradtrack.watch(cnn, backend="memory"):  # no optimizer=: a step per backward
            for _ in range(3):
                for micro in range(4):
                    images, labels = cnn_batch(seed=micro)
                    nn.functional.cross_entropy(cnn(images), labels).backward()
                optimizer.step()
                optimizer.zero_grad()
    assert len([w for w in seen if "backward passes" in str(w.message)]) == 1


def test_one_backward_per_optimizer_step_without_optimizer_is_not_warned(cnn: nn.Module) -> None:
    optimizer = torch.optim.SGD(cnn.parameters(), lr=0.01)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters())  # holds none of the watched params
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with gradtrack.watch(cnn, backend="memory") as watcher:
            train(cnn, 3, optimizer)
            other.step()
            other.step()
        for _ in range(2):
            nn.functional.cross_entropy(cnn(cnn_batch()[0]), cnn_batch()[1]).backward()
        optimizer.step()  # after close: the shared hook is gone
    assert watcher.step == 3
    assert [str(w.message) for w in seen if "backward passes" in str(w.message)] == []


def test_a_module_replaced_after_watch_is_warned_once() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with gradtrack.watch(model, backend="memory") as watcher:
        with pytest.warns(RuntimeWarning, match=r"2 was assigned after gradtrack.watch") as seen:
            model[2] = nn.Linear(4, 1)
            model[0].bias = nn.Parameter(torch.zeros(4))
        assert len(seen) == 1
        model(torch.randn(2, 4)).sum().backward()
    assert watcher.step == 1
    model[2] = nn.Linear(4, 1)  # after close: nothing is watched, nothing said


def test_a_parameter_unfrozen_later_without_optimizer_is_picked_up() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    model[0].requires_grad_(False)
    sink = MemorySink()
    with gradtrack.watch(model, backend=sink, log_every=1):
        for step in range(3):
            if step == 1:
                model[0].requires_grad_(True)
            model(torch.randn(8, 4)).pow(2).mean().backward()
            model.zero_grad()
    assert [r.layers for r in sink.records] == [("2",), ("0", "2"), ("0", "2")]


def test_after_its_first_step_a_watch_leaves_no_hook_on_the_parameters_but_one() -> None:
    """torch keeps a hook that calls into Python at every backward on each parameter that
    ever had one of its hooks; the watch's is one (the backward counter, on the first
    parameter), the backward order's and a due micro-batch's hooks go with their dicts, and
    close leaves none."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    watcher = gradtrack.watch(model, backend=MemorySink(), optimizer=optimizer, log_every=3)
    params = list(model.parameters())
    seen = []
    for _step in range(7):
        optimizer.zero_grad()
        for _micro in range(2):  # (accumulation: a due step hooks each tensor for a while)
            model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        seen.append([p._backward_hooks is None for p in params])
    assert sum(p._post_accumulate_grad_hooks is not None for p in params) == 1
    # (each tensor is hooked from the end of steps 2 and 5 for the due steps 3 and 6)
    assert [all(hooked) for hooked in seen] == [True, True, False, True, True, False, True]
    assert not any(any(hooked) for hooked in (seen[2], seen[5]))
    watcher.close()
    assert all(p._backward_hooks is None for p in params)
    assert all(not p._post_accumulate_grad_hooks for p in params)


def test_the_backward_order_is_the_order_the_gradients_were_ready_in() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    params = list(model.parameters())
    probe = BackwardOrderProbe(params, {id(p): i // 2 for i, p in enumerate(params)})
    model(torch.randn(3, 4)).sum().backward()
    assert probe.order == [2, 1, 0]
    probe.remove()
    assert all(p._backward_hooks is None for p in params)
