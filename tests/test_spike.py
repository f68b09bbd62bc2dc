"""Spike detection every step: a gradient spike between logged steps is flagged at its step,
with the default rules, and healthy training raises nothing."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gradtrack
from benchmarks.models import MODELS
from gradtrack.capture.spike import NormWindow
from gradtrack.capture.verdict import QuietSteps
from gradtrack.handoff.layout import spike_fields
from gradtrack.sinks import MemorySink

pytestmark = pytest.mark.usefixtures("one_thread")


def regression_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1)
    )


def train(
    model: nn.Module, steps: int, scale_at: dict[int, float], layer: int | None = None, **kw: object
) -> tuple[MemorySink, gradtrack.Watcher]:
    """SGD on a stable regression task (fresh batches, same distribution); at the steps of
    ``scale_at`` every gradient (or only ``layer``'s) is multiplied after backward."""
    sink = MemorySink()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, **kw) as watcher:  # type: ignore[arg-type]
        for step in range(steps):
            generator = torch.Generator().manual_seed(step)
            x = torch.randn(64, 8, generator=generator)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :1].sin()).backward()
            if step in scale_at:
                targets = model if layer is None else model[layer]
                for param in targets.parameters():
                    param.grad.mul_(scale_at[step])  # type: ignore[union-attr]
            optimizer.step()
    return sink, watcher


@pytest.mark.parametrize("latched", [False, True], ids=["read_at_step", "latched_on_device"])
def test_a_300x_gradient_at_an_unlogged_step_is_flagged_at_that_step(latched: bool) -> None:
    model = regression_model()
    sink = MemorySink()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    watcher = gradtrack.watch(model, backend=sink, optimizer=optimizer)  # default rules
    if latched:  # the accelerator's path: nothing read between logged steps
        watcher.guard_reads_host = False
        watcher.collector.foreach_only = True
    for step in range(140):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(64, 8, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :1].sin()).backward()
        if step == 123:  # after 120 stable steps, between logged steps 120 and 130
            for param in model.parameters():
                param.grad.mul_(300.0)  # type: ignore[union-attr]
        optimizer.step()
    watcher.close()
    spikes = [e for e in sink.events if e.rule == "spike"]
    assert spikes, "the spike was not flagged"
    assert {e.step for e in spikes} == {123}
    total = next(e for e in spikes if e.layer is None)
    assert total.value == pytest.approx(300 * total.threshold / 3.0, rel=0.5)  # ~300x typical
    assert "spiked" in total.message and total.statistic == "total_norm"
    record = next(r for r in sink.records if r.step == 123)
    assert record.spiking is not None and record.spiking[0]
    assert [e for e in sink.events if e.severity != "info" and e.rule != "spike"] == []


def test_a_spike_in_one_layer_names_that_layer() -> None:
    sink, _ = train(regression_model(), 140, {123: 300.0}, layer=2)
    spikes = [e for e in sink.events if e.rule == "spike"]
    assert {e.step for e in spikes} == {123}
    (event,) = [e for e in spikes if e.layer is not None]  # (the total may spike with it)
    assert (event.layer, event.layers) == ("2", ("2",))


def test_no_spike_before_warmup_and_none_in_stable_training() -> None:
    sink, _ = train(regression_model(), 150, {10: 300.0})  # step 10 < warmup (32)
    assert [e for e in sink.events if e.rule == "spike"] == []


@pytest.mark.parametrize("name", ["cnn", "mlp", "transformer"])
@pytest.mark.slow
def test_benchmark_models_train_100_steps_without_a_spike_alarm(name: str) -> None:
    torch.manual_seed(0)
    model, loss_fn = MODELS[name]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sink = MemorySink()
    with gradtrack.watch(model, backend=sink, optimizer=optimizer):
        for _ in range(100):  # 68 steps past the warm-up
            optimizer.zero_grad()
            loss_fn().backward()
            optimizer.step()
    assert [e for e in sink.events if e.rule == "spike"] == []


@pytest.mark.parametrize("refresh", [1, 5, 8], ids=["every_step", "wrapping", "refreshed"])
@pytest.mark.parametrize("host", [True, False], ids=["numpy", "torch"])
def test_window_statistics_match_a_reference_over_the_last_steps(host: bool, refresh: int) -> None:
    """z, the typical norm and the flags against a straightforward numpy computation over
    the window's accepted values (absent and non-finite norms are not accepted): step s is
    judged on the last 16 steps before its window's last refresh, ``s // refresh * refresh``
    (with ``refresh`` 1, the 16 steps just before it)."""
    rng = np.random.default_rng(0)
    series = np.exp(rng.normal(0.0, 0.1, size=(40, 2)))
    series[30, 1] *= 300.0  # a spike in layer 0's column
    series[20, 1] = 0.0  # layer 0 without a gradient
    series[25] = np.nan  # a non-finite step
    window = NormWindow(
        1, window=16, warmup=8, z=[6.0, 6.0], ratio=[3.0, 3.0], enabled=[1, 1], refresh=refresh
    )
    accepted: list[list[float]] = [[], []]  # per column and step, the value it entered with
    for step, norms in enumerate(series):
        fields = spike_fields(window.update(torch.tensor(norms), host=host).numpy())
        seen = step // refresh * refresh  # the steps before the last refresh
        for column in range(2):
            past = [v for v in accepted[column][max(0, seen - 16) : seen] if math.isfinite(v)]
            log = math.log10(norms[column]) if norms[column] > 0 else math.nan
            spiked = False
            if past and math.isfinite(log):
                mean, std = np.mean(past), max(np.std(past), 1e-3)
                z = (log - mean) / std
                assert fields["spike_z"][column] == pytest.approx(z, rel=1e-9)
                assert fields["spike_typical"][column] == pytest.approx(10**mean, rel=1e-9)
                spiked = len(past) >= 8 and z > 6.0 and log - mean > math.log10(3)
                log = mean + 6.0 * std if spiked else log  # a spike enters clipped
            else:
                assert math.isnan(fields["spike_z"][column])
            assert bool(fields["spiking"][column]) == spiked, (step, column)
            assert spiked == (step == 30 and column == 1)
            accepted[column].append(log)


def test_window_and_warmup_are_refused_as_layer_overrides() -> None:
    with pytest.raises(gradtrack.GradtrackError, match="window apply to every layer"):
        gradtrack.watch(nn.Linear(2, 2), alerts={"layers": {"*": {"spike": {"window": 8}}}})


def test_a_spike_does_not_take_a_later_nan_steps_place_in_its_window() -> None:
    """Both are summarised at their own (unlogged) steps, in one layer_every window."""
    sink, _ = train(regression_model(), 135, {123: 300.0, 125: math.nan})
    assert {e.step for e in sink.events if e.rule == "spike"} == {123}
    assert next(e.step for e in sink.events if e.rule == "nonfinite") == 125


def many_small_layers(shapes: str) -> nn.Sequential:
    """66 small tensors (the packed pass's): of 4 shapes ("few") or 51 ("many")."""
    torch.manual_seed(0)
    if shapes == "few":
        hidden = [nn.Linear(8, 8) for _ in range(32)]
    else:  # (8 → 8+i+1 → 8, i even: each pair's own shapes)
        hidden = [nn.Linear(8, 9 + i) if i % 2 == 0 else nn.Linear(8 + i, 8) for i in range(32)]
    layers: list[nn.Module] = []
    for layer in hidden:
        layers += [layer, nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(8, 1))


@pytest.mark.parametrize("shapes", ["few", "many"])
def test_many_small_layers_judge_their_quiet_steps_as_the_full_pass(shapes: str) -> None:
    """A model of many small tensors takes the packed short pass: stacked by shape where its
    tensors have few shapes (`ShapeGroups`), concatenated where they have many. Either way
    the steps are judged, recorded and alerted as in full, the flight recorder's norms the
    same to the last bit."""
    quick, quick_watcher = _judged_run(True, False, many_small_layers(shapes))
    full, _ = _judged_run(False, False, many_small_layers(shapes))
    quiet = quick_watcher.judge._quiet
    assert quiet is not None and quiet._packed is not None
    assert (quiet._shapes is not None) == (shapes == "few")
    assert [r.step for r in quick.records] == [r.step for r in full.records]
    for a, b in zip(quick.records, full.records):
        np.testing.assert_allclose(a.spike_z, b.spike_z, rtol=1e-12, equal_nan=True)  # type: ignore[arg-type]
        np.testing.assert_array_equal(a.spiking, b.spiking)  # type: ignore[arg-type]
        assert (a.flight is None) == (b.flight is None)
        if a.flight is not None and b.flight is not None:
            np.testing.assert_array_equal(a.flight.steps, b.flight.steps)
            np.testing.assert_array_equal(a.flight.norms, b.flight.norms)
    assert [(e.step, e.rule, e.layer) for e in quick.events] == [
        (e.step, e.rule, e.layer) for e in full.events
    ]
    assert any(e.rule == "spike" and e.step == 123 for e in quick.events)
    assert any(e.rule == "nonfinite" and e.step == 77 for e in quick.events)


def _judged_run(
    short_pass: bool, frozen: bool, model: nn.Sequential | None = None
) -> tuple[MemorySink, gradtrack.Watcher]:
    """140 steps with a 300x spike at step 123 and a NaN at step 77 (both between logged
    steps), with the short pass for healthy steps on or off; ``frozen``: a layer frozen
    after watching (its gradients absent)."""
    model = regression_model() if model is None else model
    sink = MemorySink()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    watcher = gradtrack.watch(model, backend=sink, optimizer=optimizer)  # default rules
    if frozen:
        model[2].requires_grad_(False)
    if not short_pass:
        watcher.judge._quiet = None  # every step judged in full
    for step in range(140):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(64, 8, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :1].sin()).backward()
        if step in (77, 123):
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.mul_(300.0 if step == 123 else math.nan)
        kept = [p.detach().clone() for p in model.parameters()]
        optimizer.step()
        if step == 77:  # the NaN update undone: training goes on healthy
            with torch.no_grad():
                for param, before in zip(model.parameters(), kept):
                    param.copy_(before)
    watcher.close()
    return sink, watcher


@pytest.mark.parametrize("frozen", [False, True], ids=["all_trained", "one_layer_frozen"])
@pytest.mark.parametrize("in_floats", [True, False], ids=["python_floats", "numpy_arrays"])
def test_healthy_steps_judged_in_the_short_pass_judge_as_the_full_pass(
    frozen: bool, in_floats: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The short pass a healthy unlogged step takes (`QuietSteps`) keeps the spike window
    and the flight recorder as judging it in full would: same records, spike statistics,
    alerts and flight windows — in Python floats (a small model's) and in numpy arrays. A
    small model's healthy logged steps take it too, and their records read the same."""
    if not in_floats:
        monkeypatch.setattr("gradtrack.capture.verdict.SMALL_MODEL_TENSORS", 0)
    short_logged: list[int] = []  # logged steps planned in the short pass
    logged = QuietSteps.logged

    def spy(self: QuietSteps, step: int, *args: Any) -> Any:
        plan = logged(self, step, *args)
        if plan is not None:
            short_logged.append(step)
        return plan

    monkeypatch.setattr(QuietSteps, "logged", spy)
    quick, quick_watcher = _judged_run(short_pass=True, frozen=frozen)
    # A small model's healthy logged steps take it too (not 0 and 100: sampled for histograms)
    assert short_logged == ([s for s in range(10, 140, 10) if s != 100] if in_floats else [])
    full, _ = _judged_run(short_pass=False, frozen=frozen)
    quiet = quick_watcher.judge._quiet
    assert quiet is not None and quiet._plan and (quiet._present is not None) == frozen
    assert (quiet._small is not None) == in_floats
    assert [r.step for r in quick.records] == [r.step for r in full.records]
    assert {77, 123} <= {r.step for r in quick.records}
    for a, b in zip(quick.records, full.records):
        np.testing.assert_allclose(a.spike_z, b.spike_z, rtol=1e-5, equal_nan=True)  # type: ignore[arg-type]
        np.testing.assert_allclose(a.spike_typical, b.spike_typical, rtol=1e-5, equal_nan=True)  # type: ignore[arg-type]
        np.testing.assert_array_equal(a.spiking, b.spiking)  # type: ignore[arg-type]
        assert (a.flight is None) == (b.flight is None)
        if a.flight is not None and b.flight is not None:
            np.testing.assert_array_equal(a.flight.steps, b.flight.steps)
            np.testing.assert_allclose(a.flight.norms, b.flight.norms, rtol=1e-5, equal_nan=True)
    assert [(e.step, e.rule, e.layer) for e in quick.events] == [
        (e.step, e.rule, e.layer) for e in full.events
    ]
    assert any(e.rule == "spike" and e.step == 123 for e in quick.events)
    assert any(e.rule == "nonfinite" and e.step == 77 for e in quick.events)
