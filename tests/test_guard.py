"""Every step guarded, with the defaults users run: a bad gradient is caught at its own step,
a raise rule keeps it out of the weights every time, and norms stay exact at the extremes."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.formats.metrics import scalar_metrics
from gradtrack.sinks import MemorySink
from tests.conftest import Told, reference_stats
from tests.test_alerts import deep_model, only


def train_poisoned(
    model: nn.Sequential, steps: int, poison_at: set[int], **overrides: object
) -> tuple[MemorySink, list[int], gradtrack.Watcher]:
    """SGD with the defaults (``log_every=10``); the Poison module writes NaN into the
    gradient reaching layer 2 at the steps in ``poison_at``. Returns the sink, the steps that
    raised (a caught GradientAlertError skips that update) and the watcher."""
    sink = MemorySink()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    raised: list[int] = []
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, **overrides) as watcher:
        for step in range(steps):
            model[3].value = float("nan") if step in poison_at else None
            optimizer.zero_grad()
            model(torch.randn(32, 8)).pow(2).mean().backward()
            try:
                optimizer.step()
            except gradtrack.GradientAlertError as error:
                assert error.event.step == step
                raised.append(step)
    return sink, raised, watcher


def test_nan_at_an_unlogged_step_is_reported_for_that_step_with_its_layers() -> None:
    model = deep_model()
    sink, raised, _ = train_poisoned(model, 30, poison_at={13})
    assert not raised
    nonfinite = only(sink.events, "nonfinite")
    assert nonfinite[0].step == 13  # not 20, the next logged step
    assert nonfinite[0].layer == "3" and nonfinite[0].layers == ("0", "2")  # 3: Poison
    assert all(e.step == 13 or e.step % 10 == 0 for e in sink.events)
    # The step's per-layer metrics were written although 13 is not a logged step (10, 20).
    steps = [r.step for r in sink.records]
    assert 13 in steps and all(s % 10 == 0 for s in steps if s != 13)
    record = next(r for r in sink.records if r.step == 13)
    assert record.per_layer and record.abs_stats
    counts = {name: int(s.nan) for name, s in record.layer_stats().items()}
    assert counts["2"] == 17 and counts["0"] > 0 and counts["5"] == counts["7"] == 0
    metrics = scalar_metrics(record)
    assert metrics["grad_nan/2"] == 17 and "grad_norm/7" in metrics and "grad_max/7" in metrics
    # The update was applied (the default action only logs): later steps are NaN everywhere
    # and are reported at the logged steps, counted, without a second notification storm.
    assert sink.records[-1].step == 20 and sink.records[-1].nan_count > 0


def test_raise_with_defaults_stops_every_bad_update_inside_one_cooldown_window() -> None:
    model = deep_model()
    sink, raised, _ = train_poisoned(
        model, 30, poison_at={3, 7}, alerts={"nonfinite": {"action": "raise"}}
    )
    assert raised == [3, 7]  # both unlogged, 4 steps apart: the cooldown (100) never hides one
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(r.nan_count == 0 for r in sink.records if r.step not in (3, 7))
    # One notification: the second raise is within the rule's cooldown.
    assert [e.step for e in only(sink.events, "nonfinite")] == [3]


def test_raise_comes_before_the_update_even_when_the_sink_is_stuck() -> None:
    """The raise is judged in the training thread: a sink blocked in a write (a frozen
    tracker) must not delay it, nor let the bad update through."""
    import threading

    release = threading.Event()

    class StuckSink(MemorySink):
        def write(self, batch: object) -> None:
            release.wait(30)

    model = deep_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    watcher = gradtrack.watch(
        model, backend=StuckSink(), optimizer=optimizer, log_every=1,
        alerts={"nonfinite": {"action": "raise"}},
    )  # fmt: skip
    try:
        for step in range(4):  # the worker is stuck in the first write from step 0 on
            model[3].value = float("nan") if step == 3 else None
            optimizer.zero_grad()
            model(torch.randn(32, 8)).pow(2).mean().backward()
            if step < 3:
                optimizer.step()
        with pytest.raises(gradtrack.GradientAlertError):
            optimizer.step()
        assert all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        release.set()
        watcher.close()


def single_layer_step(values: torch.Tensor, steps: int = 1, **overrides: object) -> MemorySink:
    """A one-parameter model whose gradient is exactly ``values`` at every step."""
    param = nn.Parameter(torch.zeros_like(values))
    model = nn.Module()
    model.register_parameter("w", param)
    sink = MemorySink()
    optimizer = torch.optim.SGD([param], lr=0.0)
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, **overrides):
        for _ in range(steps):
            loss = (param * values).sum()
            (loss.real if loss.is_complex() else loss).backward()
            optimizer.step()
            optimizer.zero_grad()
    return sink


def test_huge_finite_gradients_have_a_finite_norm_and_explode() -> None:
    sink = single_layer_step(torch.full((10_000,), 1e18), log_every=1)
    record = sink.records[0]
    assert record.total_norm == pytest.approx(1e20, rel=1e-6)
    assert record.nan_count == record.inf_count == 0
    assert {e.rule for e in sink.events} == {"exploding"}  # the layer and the total


def test_huge_finite_gradients_between_logged_steps_are_no_nan_alarm() -> None:
    """The steps between logged ones take the plain fp32 pass, whose sum overflows here:
    the verdict must still be finite (overflowed norms are redone exactly)."""
    sink = single_layer_step(torch.full((10_000,), 1e18), steps=15)  # log_every=10
    assert [r.step for r in sink.records] == [0, 10]
    assert not only(sink.events, "nonfinite")
    assert all(r.total_norm == pytest.approx(1e20, rel=1e-6) for r in sink.records)


def test_unlogged_steps_take_the_plain_pass_and_logged_steps_the_exact_one() -> None:
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(6_400_000, generator=generator) * 1e-3 + 1e-3  # sums drift in fp32
    param = nn.Parameter(torch.zeros_like(grad))
    param.grad = grad
    model = nn.Module()
    model.register_parameter("w", param)
    expected = float(grad.double().norm())
    with gradtrack.watch(model, backend=MemorySink()) as watcher:
        exact, plain = watcher.collector.guard(exact=True), watcher.collector.guard(exact=False)
    assert exact.exact and not plain.exact
    assert float(exact.devices[0].l2[0]) == pytest.approx(expected, rel=1e-6)
    assert float(plain.devices[0].l2[0]) == pytest.approx(expected, rel=1e-3)


def tiny_layers(n: int = 40) -> nn.Sequential:
    """Many small fp32 tensors (2n), the case the plain pass packs into one."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


def test_many_small_tensors_plain_pass_is_packed_and_matches_the_exact_norms() -> None:
    model = tiny_layers()
    model(torch.randn(3, 4)).pow(2).sum().backward()
    model[5].weight.grad[0, 0] = 3e-30  # fp32 squares would underflow here; fp64 ones do not
    model[6].weight.grad.fill_(0.0)
    model[6].weight.grad[1, 1] = 2e-25
    model[7].bias.grad.fill_(1e30)  # ... and overflow here
    with gradtrack.watch(model, backend=MemorySink()) as watcher:
        collector = watcher.collector
        exact, plain = collector.guard(exact=True), collector.guard(exact=False)
        (plan,) = collector.layouts._plans.values()
    assert plan[0].groups[0].offsets is not None  # (the packed pass was taken)
    expected = [float(p.grad.double().norm()) for p in collector.params]
    np.testing.assert_allclose(exact.devices[0].l2.numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(plain.devices[0].l2.numpy(), expected, rtol=1e-6)
    assert plain.devices[0].l2[12] == pytest.approx(2e-25, rel=1e-6)  # layer 6's weight


@pytest.mark.parametrize("ring", [False, True], ids=["own-copy", "shared-ring"])
def test_a_logged_step_of_many_small_tensors_concatenates_its_gradients_once(
    ring: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A logged step of a small CPU model goes to the worker as one copy of its gradients end
    to end, and the guard's packed pass over many small tensors concatenates them too: once
    a step serves both (a concatenation costs ~0.5 µs a tensor). The copy is the step's: a
    change to the gradients after it does not reach the record, in an ordinary tensor or in
    the ring a worker process reads."""
    from gradtrack.capture import collect, stats
    from gradtrack.handoff.shared import SharedCopies

    model = tiny_layers()
    params = list(model.parameters())
    concatenated: list[int] = []  # each concatenation of the gradients: its tensors
    flatten = stats.flatten

    def counting(tensors: list[torch.Tensor]) -> torch.Tensor:
        first = params[0].grad
        if first is not None and any(t.data_ptr() == first.data_ptr() for t in tensors):
            concatenated.append(len(tensors))
        return flatten(tensors)

    stacking = stats.ShapeGroups.flatten  # (its tensors of two shapes: stacked per shape)

    def counting_stacks(self: stats.ShapeGroups, tensors: list[torch.Tensor]) -> torch.Tensor:
        concatenated.append(len(tensors))
        return stacking(self, tensors)

    monkeypatch.setattr(collect, "flatten", counting)
    monkeypatch.setattr(stats, "flatten", counting)
    monkeypatch.setattr(stats.ShapeGroups, "flatten", counting_stacks)
    sink, expected = MemorySink(), []
    with gradtrack.watch(model, backend=sink, log_every=1) as watcher:
        if ring:
            watcher.collector.whole.shared = SharedCopies.create(1 << 20)
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(3, 4)).pow(2).sum().backward()  # (the step ends here)
            expected.append(
                [
                    float(torch.cat([p.grad.reshape(-1) for p in pair]).norm())
                    for pair in zip(params[::2], params[1::2])
                ]
            )
            for param in params:
                param.grad.fill_(7.0)  # (after the step: not what it logged)
        watcher.flush()
    assert concatenated == [len(params)] * 3  # (one a logged step)
    assert [r.step for r in sink.records] == [0, 1, 2]
    for record, norms in zip(sink.records, expected):
        np.testing.assert_allclose(record.column("norm"), norms, rtol=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_step_among_many_small_tensors_is_caught_at_its_step(bad: float) -> None:
    """Unlogged steps of a model of many small layers take the packed plain pass: a NaN or
    an Inf in one element of one layer at step 3 (log_every=10) is named at step 3."""
    model = tiny_layers()
    sink = MemorySink()
    poisoned = {"step": -1}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if poisoned["step"] == 3:
            grad = grad.clone()
            grad[2, 1] = bad
        return grad

    model[17].weight.register_hook(poison)
    with gradtrack.watch(model, backend=sink):  # (a step per backward; weights untouched)
        for step in range(12):
            poisoned["step"] = step
            model.zero_grad()
            model(torch.randn(3, 4)).pow(2).sum().backward()
    assert [r.step for r in sink.records] == [0, 3, 10]
    record = sink.records[1]
    counts = dict(zip(record.layers, record.column("nan" if math.isnan(bad) else "inf")))
    assert counts["17"] == 1 and sum(counts.values()) == 1
    assert [e.step for e in only(sink.events, "nonfinite")] == [3]


def test_a_bad_unlogged_step_is_summarised_with_exact_norms() -> None:
    """Step 3 is unlogged, so its guard took the plain pass; being bad, it is summarised,
    and the healthy large layer's norm must then be exact."""
    generator = torch.Generator().manual_seed(0)
    big = torch.randn(6_400_000, generator=generator) * 1e-3 + 1e-3
    model = nn.ModuleDict({"big": nn.Linear(1, 1), "small": nn.Linear(1, 1)})
    weights = {"big": nn.Parameter(torch.zeros_like(big)), "small": nn.Parameter(torch.zeros(4))}
    for name, param in weights.items():  # one parameter per layer, named after its module
        model[name].weight = param
        model[name].bias = None
    sink = MemorySink()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with gradtrack.watch(model, backend=sink, optimizer=optimizer):
        for step in range(4):
            small = torch.full((4,), float("nan") if step == 3 else 1.0)
            ((weights["big"] * big).sum() + (weights["small"] * small).sum()).backward()
            optimizer.step()
            optimizer.zero_grad()
    bad = [r for r in sink.records if r.step == 3]
    assert len(bad) == 1
    norms = dict(zip(bad[0].layers, bad[0].column("norm")))
    assert norms["big"] == pytest.approx(float(big.double().norm()), rel=1e-6)
    assert math.isnan(norms["small"])


def test_tiny_gradients_never_read_as_zero_on_any_kind_of_step() -> None:
    # Step 0 is a per-layer step (max/mean |g| too), steps 1 and 2 take the L2 alone.
    sink = single_layer_step(torch.full((10_000,), 1e-24), steps=3, log_every=1)
    norms = [r.column("norm")[0] for r in sink.records]
    assert [r.abs_stats for r in sink.records] == [True, False, False]
    assert norms[0] == pytest.approx(1e-22, rel=1e-6)
    assert norms[0] == norms[1] == norms[2]  # the same tensor, the same number
    assert not only(sink.events, "dead")


@pytest.mark.parametrize("values", [[0.5], [3.0] * 1000, [-1e-40] * 7, [3e38, -3e38]])
@pytest.mark.parametrize("scale", ["linear", "log"])
def test_constant_and_extreme_gradients_bin_and_keep_the_rules(
    values: list[float], scale: str
) -> None:
    grad = torch.tensor(values, dtype=torch.float32)
    sink = single_layer_step(
        grad,
        log_every=1,
        histograms={"every": 1, "scale": scale},
        alerts={"exploding": {"threshold": 1}},
    )
    record = sink.records[0]
    histogram = record.histograms["root"]
    assert histogram.sample_size == len(values)
    assert np.all(np.diff(histogram.edges) > 0) and np.all(np.isfinite(histogram.edges))
    expected = reference_stats([grad])["norm"]
    assert record.total_norm == pytest.approx(expected, rel=1e-6)
    assert {e.rule for e in sink.events} == ({"exploding"} if expected > 1 else set())


def test_a_failing_histogram_mocked_costs_only_the_histograms(
    monkeypatch: pytest.MonkeyPatch, told: Told
) -> None:
    """Mocked: no real input makes binning fail any more, so a failure is forced."""

    def broken(*_: object) -> None:
        raise ValueError("binning broke")

    monkeypatch.setattr("gradtrack.worker.assemble.bin_samples", broken)
    sink = single_layer_step(
        torch.full((100,), 5.0), steps=3, log_every=1, histograms={"every": 1},
        alerts={"exploding": {"threshold": 1, "cooldown_steps": 0}},
    )  # fmt: skip
    assert told.count("could not build the histograms") == 1  # reported once
    assert [r.step for r in sink.records] == [0, 1, 2]
    assert all(r.histograms == {} for r in sink.records)
    assert sorted({e.step for e in sink.events}) == [0, 1, 2]  # the rules ran at every step


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_large_tensor_statistics_within_1e_6_of_fp64(dtype: torch.dtype) -> None:
    """A GPT-2-sized embedding gradient (6.4 M elements, offset so that sums drift)."""
    generator = torch.Generator().manual_seed(0)
    grad = (torch.randn(6_400_000, generator=generator) * 1e-3 + 1e-3).to(dtype)
    record = single_layer_step(grad, log_every=1).records[0]
    expected = reference_stats([grad])
    stats = record.layer_stats()["root"]
    for name in ("norm", "mean_abs", "max_abs", "rms"):
        assert getattr(stats, name) == pytest.approx(expected[name], rel=1e-6), name


def test_fp64_gradients_beyond_fp64_squares_keep_exact_norms() -> None:
    grad = torch.tensor([1e200, -1e200, 3e-200], dtype=torch.float64)
    record = single_layer_step(grad, log_every=1).records[0]
    assert record.total_norm == pytest.approx(math.sqrt(2) * 1e200, rel=1e-12)
    assert record.column("rms")[0] == pytest.approx(math.sqrt(2 / 3) * 1e200, rel=1e-12)


def test_complex_gradients_are_summarised_as_their_modulus() -> None:
    grad = torch.tensor([3 + 4j, 0 - 12j, 9 + 12j, 0j], dtype=torch.complex64)
    record = single_layer_step(grad, log_every=1).records[0]
    modulus = grad.abs().double()
    stats = record.layer_stats()["root"]
    assert stats.norm == pytest.approx(float(modulus.norm()), rel=1e-6)  # 20, not 12
    assert stats.max_abs == pytest.approx(15.0) and stats.mean_abs == pytest.approx(8.0)
    assert stats.numel == 4


def test_guard_cost_on_healthy_unlogged_steps_is_one_pass(tmp_path: Path) -> None:
    """Healthy unlogged steps hand nothing to the worker: one copy per logged step only."""
    model = deep_model()
    sink, raised, watcher = train_poisoned(model, 25, poison_at=set())
    assert not raised and [r.step for r in sink.records] == [0, 10, 20]
    assert watcher.host_transfers == 3


def test_accelerator_path_latches_an_unlogged_nan_step_without_a_host_read() -> None:
    """The path CUDA takes (no verdict read at the step; foreach kernels), forced on the CPU:
    the first bad step between logged steps reaches the worker with the next logged step."""
    from tests.test_no_sync import OpRecorder

    model = deep_model()
    sink = MemorySink()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    recorder = OpRecorder()
    with gradtrack.watch(model, backend=sink, optimizer=optimizer) as watcher:
        watcher.guard_reads_host = False
        watcher.collector.foreach_only = True
        with recorder:
            for step in range(25):
                model[3].value = float("nan") if step in (13, 15) else None
                optimizer.zero_grad()
                model(torch.randn(32, 8)).pow(2).mean().backward()
                optimizer.step()
    assert recorder.ops["_local_scalar_dense"] == 0  # never a read that waits for a device
    # 13: latched, read at step 20; 21 (the NaN weights keep every later step bad): the first
    # bad step after the last logged one, read at close.
    assert [r.step for r in sink.records] == [0, 10, 13, 20, 21]
    assert not sink.records[-1].counted and math.isnan(sink.records[-1].total_norm)
    latched = sink.records[2]
    assert not latched.counted and latched.per_layer and not latched.abs_stats
    norms = dict(zip(latched.layers, latched.column("norm").tolist()))
    assert math.isnan(norms["2"]) and math.isnan(norms["0"]) and math.isfinite(norms["7"])
    assert "grad/nan_count" not in scalar_metrics(latched)  # not counted: never written as 0
    nonfinite = only(sink.events, "nonfinite")
    assert nonfinite[0].step == 13 and nonfinite[0].layer == "2"
    assert nonfinite[0].layers == ("0", "2") and "not counted" in nonfinite[0].message


def _assembling_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The threads that build records, spied on (the real assembly runs)."""
    from gradtrack.worker.assemble import Assembler

    threads: list[str] = []
    assemble = Assembler.assemble

    def spied(self: Assembler, pending: object) -> object:
        import threading

        threads.append(threading.current_thread().name)
        return assemble(self, pending)  # type: ignore[arg-type]

    monkeypatch.setattr(Assembler, "assemble", spied)
    return threads


def test_a_raise_rule_the_norms_trip_is_judged_by_the_worker_before_the_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads = _assembling_threads(monkeypatch)
    model = deep_model()
    sink, raised, _ = train_poisoned(
        model, 30, poison_at={13}, alerts={"nonfinite": {"action": "raise"}}
    )
    assert raised == [13] and all(torch.isfinite(p).all() for p in model.parameters())
    assert threads and set(threads) == {"gradtrack-worker"}  # never the training thread
    (event,) = only(sink.events, "nonfinite")
    assert event.step == 13 and event.layer == "3"  # the worker's event, its origin named


def test_a_raise_rule_only_the_worker_can_judge_stops_at_its_logged_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vanishing needs the record (patience over logged steps): each logged step is judged
    by the worker before its optimizer step, and the update signals still reach it."""
    threads = _assembling_threads(monkeypatch)
    model = deep_model()
    rules = {"vanishing": {"action": "raise", "threshold": 1e3, "patience": 3}}
    sink, raised, _ = train_poisoned(model, 40, poison_at=set(), alerts=rules)
    assert raised == [20, 30]  # patience 3 of the logged steps 0, 10, 20; then every one
    assert set(threads) == {"gradtrack-worker"}
    judged = [r for r in sink.records if r.step in (0, 10)]
    assert len(judged) == 2 and all(r.update_norms is not None for r in judged)
