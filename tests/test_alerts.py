"""Alert rules on real models with injected faults: NaN/Inf origins, thresholds, actions, AMP."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.capture.probes import OutputProbe
from gradtrack.errors import GradientWarning, GradtrackConfigError
from gradtrack.formats.event import AlertEvent
from gradtrack.sinks import ConsoleSink, MemorySink
from tests.conftest import NoUpdate


class PoisonGrad(torch.autograd.Function):
    """Identity forward; backward writes ``value`` (NaN or Inf) into one gradient element."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, value: float) -> torch.Tensor:
        ctx.value = value
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        poisoned = grad.clone()
        poisoned[0, 0] = ctx.value
        return poisoned, None


class Poison(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.value: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.value is None else PoisonGrad.apply(x, self.value)


def deep_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), Poison(), nn.Tanh(),
        nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2),
    )  # fmt: skip


def train(
    model: nn.Module,
    steps: int,
    *,
    lr: float | None = 0.01,
    inputs: Callable[[int], torch.Tensor] = lambda step: torch.randn(32, 8),
    loss_of: Callable[[torch.Tensor], torch.Tensor] = lambda out: out.pow(2).mean(),
    before: Callable[[int], None] = lambda step: None,
    **overrides: Any,
) -> tuple[MemorySink, gradtrack.Watcher]:
    sink = MemorySink()
    # lr=None: an optimizer that applies nothing, so a poisoned step cannot poison the weights.
    optimizer = (
        NoUpdate(model.parameters()) if lr is None else torch.optim.SGD(model.parameters(), lr=lr)
    )
    overrides.setdefault("log_every", 1)
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, **overrides) as watcher:
        for step in range(steps):
            before(step)
            optimizer.zero_grad()
            loss_of(model(inputs(step))).backward()
            optimizer.step()
    return sink, watcher


def only(events: list[AlertEvent], rule: str) -> list[AlertEvent]:
    return [event for event in events if event.rule == rule]


@pytest.mark.parametrize(("value", "kind"), [(float("nan"), "NaN"), (float("inf"), "Inf")])
def test_nonfinite_in_backward_names_the_layer_where_it_appeared(value: float, kind: str) -> None:
    model = deep_model()

    def poison(step: int) -> None:
        model[3].value = value if step == 4 else None

    sink, _ = train(model, 6, lr=None, before=poison)
    (event,) = only(sink.events, "nonfinite")
    # Made by the Poison module's backward (3), not by the parameterised layer below it (2).
    assert (event.step, event.layer, event.severity) == (4, "3", "error")
    assert (event.origin_layer, event.origin_stage) == ("3", "backward")
    assert event.message.startswith(f"{kind} gradient first at 3 (backward; model output finite)")
    assert "Try:" in event.message
    assert event.model_dump_json()  # JSON-serialisable


def test_nonfinite_forward_is_told_apart() -> None:
    model = deep_model()

    def inputs(step: int) -> torch.Tensor:
        x = torch.randn(32, 8)
        if step == 2:
            x[0, 0] = float("nan")
        return x

    sink, _ = train(model, 4, lr=None, inputs=inputs)
    (event,) = only(sink.events, "nonfinite")
    assert event.step == 2 and event.origin_stage == "forward"
    assert event.message.startswith("NaN gradient from the input batch: it already held NaN")


def test_nonfinite_from_the_loss_is_told_apart() -> None:
    model = deep_model()
    sink, _ = train(model, 1, lr=None, loss_of=lambda out: (out * 0).log().sum())
    (event,) = only(sink.events, "nonfinite")
    assert event.origin_stage == "loss" and event.origin_layer is None
    assert event.message.startswith(
        "NaN gradient made by the loss: the gradient reaching the model output was already "
        "non-finite. "
    ), event.message
    assert event.layer is None and event.title == (
        f"gradtrack: nonfinite in {len(event.layers)} layers, made by the loss"
    )


def test_huge_learning_rate_explodes() -> None:
    model = deep_model()
    sink, _ = train(model, 10, lr=50.0, alerts={"exploding": {"threshold": 100.0}})
    events = only(sink.events, "exploding")
    assert events and events[0].value > 100.0 and events[0].threshold == 100.0
    assert "clip_grad_norm_" in events[0].message


def test_deep_sigmoid_mlp_vanishes_after_patience() -> None:
    torch.manual_seed(0)
    layers = [m for _ in range(12) for m in (nn.Linear(16, 16), nn.Sigmoid())]
    model = nn.Sequential(*layers, nn.Linear(16, 1))
    rules = {"vanishing": {"threshold": 1e-6, "patience": 3}, "jump": {"enabled": False}}
    sink, _ = train(model, 5, inputs=lambda step: torch.randn(32, 16), alerts=rules)
    (event,) = only(sink.events, "vanishing")  # every starving layer in one event
    assert set(event.layers) >= {"0", "2"}  # the first layers starve
    assert event.step == 2  # patience 3: steps 0, 1, 2
    assert "residual connections" in event.message


def test_layers_tripping_together_make_one_event_led_by_the_worst() -> None:
    torch.manual_seed(0)
    layers = [m for _ in range(40) for m in (nn.Linear(16, 16), nn.Sigmoid())]
    model = nn.Sequential(*layers, nn.Linear(16, 1))
    vanishing = {"threshold": 1e-3, "patience": 1, "cooldown_steps": 0}
    rules = {"vanishing": vanishing, "jump": {"enabled": False}}
    sink, _ = train(model, 3, lr=None, inputs=lambda step: torch.randn(32, 16), alerts=rules)
    events = only(sink.events, "vanishing")
    assert [e.step for e in events] == [0, 1, 2]  # one per step, however many layers
    event = events[0]
    norms = dict(zip(sink.records[0].layers, sink.records[0].column("norm")))
    starving = [name for name, norm in norms.items() if 0 < norm < 1e-3]
    assert len(starving) > 20 and list(event.layers) == starving  # depth order
    assert event.layer == min(starving, key=norms.__getitem__) == starving[0]
    assert event.value == pytest.approx(norms[event.layer])
    more = len(starving) - 1
    assert event.title == f"gradtrack: vanishing in {event.layer} and {more} more layers"
    assert f"Vanishing in {len(starving)} layers at once" in event.message
    assert "and " + str(len(starving) - 9) + " more" in event.message


def test_layers_with_different_actions_stay_apart() -> None:
    torch.manual_seed(0)
    layers = [m for _ in range(6) for m in (nn.Linear(16, 16), nn.Sigmoid())]
    model = nn.Sequential(*layers, nn.Linear(16, 1))
    rules = {
        "vanishing": {"threshold": 1.0, "patience": 1},
        "jump": {"enabled": False},
        "layers": {"0": {"vanishing": {"severity": "error"}}},
    }
    sink, _ = train(model, 1, lr=None, inputs=lambda step: torch.randn(32, 16), alerts=rules)
    error, warning = sorted(only(sink.events, "vanishing"), key=lambda e: e.severity)
    assert (error.layers, error.severity) == (("0",), "error")
    assert "0" not in warning.layers and len(warning.layers) >= 3


def test_masked_layer_is_dead() -> None:
    model = deep_model()
    model[5].register_forward_hook(lambda module, args, out: out * 0)  # the layer's output dropped
    sink, _ = train(model, 4, alerts={"dead": {"patience": 3}})
    (event,) = only(sink.events, "dead")
    # Zeroing 5's output starves 5 and everything upstream of it; 7 still learns: the event
    # leads with 5, where the flow stops.
    assert (event.layers, event.step, event.layer) == (("0", "2", "5"), 2, "5")
    assert "The flow stops here: 7" in event.message and "unintended freeze" in event.message


def test_spike_after_warmup_and_cooldown_suppresses_repeats() -> None:
    model = deep_model()

    def inputs(step: int) -> torch.Tensor:
        return torch.randn(32, 8) * (1000.0 if step >= 8 else 1.0)

    rules = {
        "spike": {"ratio": 5.0, "warmup": 3, "cooldown_steps": 100},
        "exploding": {"enabled": False},
        "jump": {"enabled": False},
    }
    sink, _ = train(model, 12, lr=None, inputs=inputs, alerts=rules)
    (event,) = only(sink.events, "spike")  # once for all layers, then cooled down
    assert event.step == 8 and event.layer in event.layers
    norms = dict(zip(sink.records[8].layers, sink.records[8].column("norm")))
    assert event.value == pytest.approx(max(norms[name] for name in event.layers))


def test_jump_names_the_weak_side_of_a_break() -> None:
    model = deep_model()
    model[4].register_forward_hook(lambda module, args, out: out * 1e-4)
    sink, _ = train(model, 1, lr=None, alerts={"jump": {"ratio": 100.0}})
    (event,) = only(sink.events, "jump")
    # Layers 0 and 2 get 1e-4 of the gradient; 5 (whose input is scaled, but not its bias's
    # gradient) and 7 do not: the break is between 2 and 5, and 2 is the weak side.
    assert event.layer == "2" and event.value > 100.0
    assert event.message.startswith("Gradient flow breaks between 2 and 5")


def test_glob_overrides_apply_per_layer() -> None:
    model = deep_model()
    rules = {
        "exploding": {"threshold": 1e9},
        "layers": {"7": {"exploding": {"threshold": 1e-9, "severity": "error"}}},
    }
    sink, _ = train(model, 1, lr=None, alerts=rules)
    (event,) = only(sink.events, "exploding")
    assert (event.layer, event.threshold, event.severity) == ("7", 1e-9, "error")


def test_disabled_rule_stays_quiet() -> None:
    model = deep_model()
    model[3].value = float("nan")
    sink, _ = train(model, 2, lr=None, alerts={"nonfinite": {"enabled": False}})
    assert not only(sink.events, "nonfinite") and sink.records[0].nan_count > 0


def test_raise_stops_training_before_the_bad_step_is_applied() -> None:
    model = deep_model()
    snapshots: list[list[torch.Tensor]] = []

    def before(step: int) -> None:
        snapshots.append([p.detach().clone() for p in model.parameters()])
        model[3].value = float("nan") if step == 3 else None

    with pytest.raises(gradtrack.GradientAlertError) as error:
        train(model, 6, before=before, alerts={"nonfinite": {"action": "raise"}})
    assert error.value.event.step == 3 and error.value.event.layer == "3"
    assert len(snapshots) == 4
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), snapshots[3]))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_raise_without_optimizer_comes_out_of_backward() -> None:
    model = deep_model()
    model[3].value = float("nan")
    with gradtrack.watch(
        model, backend="memory", log_every=1, alerts={"nonfinite": {"action": "raise"}}
    ):
        with pytest.raises(gradtrack.GradientAlertError, match="NaN gradient first at 3"):
            model(torch.randn(4, 8)).sum().backward()


def test_warn_action_and_on_alert_callback() -> None:
    model = deep_model()
    model[3].value = float("inf")
    seen: list[AlertEvent] = []
    with pytest.warns(GradientWarning, match="gradient first at 3"):
        train(model, 1, lr=None, on_alert=seen.append, alerts={"nonfinite": {"action": "warn"}})
    assert [e.rule for e in seen] == ["nonfinite"]


def test_console_prints_every_event() -> None:
    model = deep_model()
    model[3].value = float("nan")
    stream = io.StringIO()
    optimizer = NoUpdate(model.parameters())
    console = ConsoleSink(interval_s=3600, stream=stream)
    with gradtrack.watch(model, backend=console, optimizer=optimizer, log_every=1):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    assert "gradtrack ERROR at step 0: NaN gradient first at 3" in stream.getvalue()


def amp_training(
    steps: int, poison_from: int | None, init_scale: float, **overrides: Any
) -> MemorySink:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1000)
    sink = MemorySink()
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, scaler=scaler, log_every=1,
                         **overrides):  # fmt: skip
        for step in range(steps):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(16, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            if poison_from is not None and step >= poison_from:
                model[0].weight.grad[0, 0] = float("inf")
            scaler.step(optimizer)
            scaler.update()
    return sink


def test_amp_overflow_steps_are_info_and_summaries_unscaled() -> None:
    sink = amp_training(steps=30, poison_from=None, init_scale=2.0**20)
    skipped = [r.step for r in sink.records if r.amp_skipped]
    assert skipped == [0, 1]  # the scale starts too high for fp16, then settles
    infos = only(sink.events, "amp")
    assert [e.severity for e in infos] == ["info"] * len(infos) and len(infos) == len(skipped)
    assert infos[0].message == "Overflow: step skipped, scale 1.04858e+06→524288."
    assert not only(sink.events, "nonfinite")  # a skipped overflow is not an error
    applied = [r for r in sink.records if r.amp_skipped is False]
    assert applied and all(0 < r.total_norm < 100 for r in applied)  # unscaled, not ×2^30


def test_a_failed_watch_leaves_model_and_scaler_untouched() -> None:
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    scaler = torch.amp.GradScaler("cpu")
    watcher = gradtrack.watch(first, backend="memory", scaler=scaler)
    before = (
        dict(second._forward_hooks),
        [dict(p._post_accumulate_grad_hooks or {}) for p in second.parameters()],
    )
    with pytest.raises(gradtrack.GradtrackError, match="GradScaler is already watched"):
        gradtrack.watch(second, backend="memory", scaler=scaler)
    after = (
        dict(second._forward_hooks),
        [dict(p._post_accumulate_grad_hooks or {}) for p in second.parameters()],
    )
    assert after == before
    watcher.close()
    assert "update" not in vars(scaler)
    gradtrack.watch(second, backend="memory", scaler=scaler).close()  # now it can be watched


def test_amp_persistent_overflow_is_an_error() -> None:
    sink = amp_training(
        steps=50, poison_from=35, init_scale=2.0**8, alerts={"amp": {"max_skips": 5}}
    )
    assert [r.step for r in sink.records if r.amp_skipped] == list(range(35, 50))
    errors = [e for e in only(sink.events, "amp") if e.severity == "error"]
    assert errors and errors[0].step == 39 and "skipped 5 steps in a row" in errors[0].message
    assert [e.step for e in only(sink.events, "amp")][:5] == [35, 36, 37, 38, 39]


def test_invalid_rules_name_the_field_and_allowed_values() -> None:
    with pytest.raises(
        GradtrackConfigError, match=r"alerts.exploding.threshold = -1 .*greater than 0"
    ):
        gradtrack.watch(nn.Linear(2, 2), alerts={"exploding": {"threshold": -1}})
    with pytest.raises(
        GradtrackConfigError, match=r"action = 'stop' .*'log', 'warn', 'raise' or 'skip'"
    ):
        gradtrack.watch(nn.Linear(2, 2), alerts={"nonfinite": {"action": "stop"}})
    with pytest.raises(GradtrackConfigError, match=r"unknown rule 'vanish'; rules: nonfinite"):
        gradtrack.watch(nn.Linear(2, 2), alerts={"layers": {"x*": {"vanish": {}}}})
    with pytest.raises(
        GradtrackConfigError, match=r"layers\['x\*'\].dead: patience = 0: .*greater than 0"
    ):
        gradtrack.watch(nn.Linear(2, 2), alerts={"layers": {"x*": {"dead": {"patience": 0}}}})


def test_rules_load_from_environment_variables() -> None:
    from gradtrack.config import load_config

    config = load_config(
        {"alerts": {"spike": {"ratio": 3}}},
        environ={
            "GRADTRACK_ALERTS__EXPLODING__THRESHOLD": "5",
            "GRADTRACK_ALERTS__SPIKE__WARMUP": "2",
        },
    )
    assert config.alerts.exploding.threshold == 5.0
    assert (config.alerts.spike.warmup, config.alerts.spike.ratio) == (2, 3.0)


def test_activation_gradient_flow_matches_reference_and_refines_the_origin() -> None:
    model = deep_model()
    outputs: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            out.retain_grad()
            outputs[name] = out

        return hook

    for name, module in model.named_children():
        module.register_forward_hook(keep(name))
    model[3].value = float("nan")
    sink, watcher = train(model, 1, lr=None, activations=True)
    assert watcher.activation_names == tuple(str(i) for i in range(8))
    scalars = {key: values[0][1] for key, values in sink.scalars().items()}
    for name, out in outputs.items():
        reference = out.grad.double().norm().item()
        got = scalars[f"act_grad_norm/{name}"]
        assert got == pytest.approx(reference, rel=1e-6, nan_ok=True), name
    (event,) = only(sink.events, "nonfinite")
    assert sink.records[0].activation_origin == "2"
    assert "first non-finite activation gradient was at the output of 2" in event.message


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.body(x).relu()
        return self.a(hidden), self.b(hidden)


def test_a_record_holds_the_norm_of_the_gradient_reaching_the_model_output() -> None:
    """The learning-rate rule tells a fit (the loss sends little) from a collapse (layers stop
    passing on what the loss sends) by it: every output's gradient, one norm together."""
    torch.manual_seed(0)
    model, sink, expected = TwoHeads(), MemorySink(), []
    with gradtrack.watch(model, backend=sink, log_every=2):
        for step in range(6):
            a, b = model(torch.randn(5, 4))
            a.retain_grad(), b.retain_grad()
            (a.pow(2).mean() + 3 * b.sum()).backward()
            if step % 2 == 0:
                expected.append(float(torch.hypot(a.grad.norm(), b.grad.norm())))
    assert [r.step for r in sink.records] == [0, 2, 4]
    assert [r.output_grad_norm for r in sink.records] == pytest.approx(expected, rel=1e-6)


# How a logged step's output checks are made: a small float32 CPU output is kept, with the
# gradients that reach it, and checked by the worker from the step's one copy (``worker``) or,
# where the step is reduced on the training thread, just before its evidence is packed
# (``training_thread``); a larger one is checked in the forward and backward hooks (``hooks``).
OUTPUT_PATHS = ("worker", "training_thread", "hooks")
OUTPUT_CASES = {
    "healthy": (lambda x: x, lambda a, b: a.pow(2).mean() + 3 * b.sum()),
    "forward_nan": (lambda x: x.index_fill(1, torch.tensor([0]), math.nan), None),
    "loss_inf": (lambda x: x, lambda a, b: a.pow(2).mean() + (b * math.inf).sum()),
}


@pytest.mark.parametrize("case", OUTPUT_CASES)
@pytest.mark.parametrize("path", OUTPUT_PATHS)
def test_the_output_checks_agree_whichever_way_they_are_made(path: str, case: str) -> None:
    """Finite output, finite gradient reaching it, that gradient's norm over both heads: the
    same in the record whoever checks them, as an independent reference has them; on the
    worker's way the training thread checks nothing."""
    from gradtrack.capture import collect, probes
    from gradtrack.handoff.layout import FlatGrads, KeptOutputs

    spoil, loss_of = OUTPUT_CASES[case]
    loss_of = loss_of or OUTPUT_CASES["healthy"][1]
    carried: list[Any] = []  # what each small step's copy held of its output
    checked_here: list[str] = []  # checks the training thread made
    reduce, checked, output_grad = FlatGrads.reduce, KeptOutputs.checked, OutputProbe._output_grad

    def spy_reduce(self: FlatGrads) -> Any:
        carried.append(self.outputs)
        return reduce(self)

    def spy_checked(self: KeptOutputs) -> Any:
        checked_here.append("kept")
        return checked(self)

    def spy_output_grad(self: OutputProbe, grad: torch.Tensor) -> None:
        checked_here.append("hook")
        output_grad(self, grad)

    torch.manual_seed(0)
    model, sink, expected = TwoHeads(), MemorySink(), []
    optimizer = NoUpdate(model.parameters())
    defer = 0 if path == "training_thread" else collect.DEFER_BELOW_ELEMENTS
    keep = 0 if path == "hooks" else probes.KEEP_OUTPUT_ELEMENTS
    with (
        mock.patch.object(FlatGrads, "reduce", spy_reduce),
        mock.patch.object(KeptOutputs, "checked", spy_checked),
        mock.patch.object(OutputProbe, "_output_grad", spy_output_grad),
        mock.patch.object(collect, "DEFER_BELOW_ELEMENTS", defer),
        mock.patch.object(probes, "KEEP_OUTPUT_ELEMENTS", keep),
        gradtrack.watch(model, backend=sink, optimizer=optimizer, log_every=1),
    ):
        for _ in range(3):
            optimizer.zero_grad()
            a, b = model(spoil(torch.randn(5, 4)))
            reached: list[torch.Tensor] = []
            a.register_hook(reached.append), b.register_hook(reached.append)
            loss_of(a, b).backward()
            optimizer.step()
            outputs = torch.cat([a.detach().reshape(-1), b.detach().reshape(-1)])
            grads = torch.cat([g.reshape(-1) for g in reached]).double()
            finite = (bool(outputs.isfinite().all()), bool(grads.isfinite().all()))
            norm = float(grads.norm())
            expected.append((*finite, None if math.isnan(norm) else norm))  # (NaN: unknown)
    got = [(r.output_finite, r.output_grad_finite, r.output_grad_norm) for r in sink.records]
    assert [g[:2] for g in got] == [e[:2] for e in expected]
    assert [g[2] is None for g in got] == [e[2] is None for e in expected]
    np.testing.assert_allclose(
        [g[2] for g in got if g[2] is not None],
        [e[2] for e in expected if e[2] is not None],
        rtol=1e-6,
    )
    if path == "worker":
        assert carried == [(25, 25, True)] * 3 and checked_here == []
    else:
        assert set(carried) <= {None}
        assert checked_here == (["kept"] * 3 if path == "training_thread" else ["hook"] * 6)


@pytest.mark.slow
def test_the_worker_process_checks_a_small_output_from_the_steps_copy(tmp_path: Path) -> None:
    """In the MLflow child process: a loss that sends NaN to the model's output is told by the
    output checks the child made from the step's copy, in the alert it stored."""
    from gradtrack.formats.mlflow import read_alerts
    from gradtrack.worker.process import WorkerProcess

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    model = deep_model()
    optimizer = NoUpdate(model.parameters())
    with gradtrack.watch(
        model, "mlflow", optimizer=optimizer, log_every=1, mlflow={"tracking_uri": uri}
    ) as watcher:
        assert isinstance(watcher.worker, WorkerProcess)
        for step in range(3):
            optimizer.zero_grad()
            out = model(torch.randn(32, 8))
            (out * 0).log().sum().backward() if step == 1 else out.pow(2).mean().backward()
            optimizer.step()
    (event,) = [e for e in read_alerts(watcher.sinks[0].run_id, uri) if e.rule == "nonfinite"]
    assert event.step == 1 and event.origin_stage == "loss"
    assert "the gradient reaching the model output was already non-finite" in event.message


@pytest.mark.parametrize("path", ["worker", "hooks"])
def test_a_bad_steps_replay_is_not_counted_as_its_forward(path: str) -> None:
    """The replay that finds where a NaN arose runs the model again: the step's output checks,
    its examples and the output gradient the user retained are the step's own, once."""
    from gradtrack.capture import probes

    model = deep_model()
    optimizer = NoUpdate(model.parameters())
    sink, reached = MemorySink(), []
    keep = 0 if path == "hooks" else probes.KEEP_OUTPUT_ELEMENTS
    with (
        mock.patch.object(probes, "KEEP_OUTPUT_ELEMENTS", keep),
        gradtrack.watch(model, backend=sink, optimizer=optimizer, log_every=1) as watcher,
    ):
        model[3].value = math.nan  # (the backward breaks inside the model)
        out = model(torch.randn(32, 8))
        out.retain_grad()
        out.register_hook(reached.append)
        out.pow(2).mean().backward()
        optimizer.step()
        assert out.grad is not None and torch.equal(out.grad, reached[0])
        batches = watcher.probes.batches
        assert batches is not None and batches.examples == 0  # (the next step's, so far)
    (record,) = sink.records
    assert record.origin_module == "3" and record.output_grad_finite is True
    assert record.output_grad_norm == pytest.approx(float(reached[0].double().norm()), rel=1e-6)


@pytest.mark.parametrize("path", ["worker", "hooks"])
def test_the_output_checks_cover_every_micro_batch_of_a_step(path: str) -> None:
    """Two forward and backward passes per step (gradient accumulation): the gradient that
    reached each micro-batch's output counts, once, in the step's norm, and the first's
    ``.grad`` the user retained lives until the second forward, as it would unwatched."""
    from gradtrack.capture import probes

    torch.manual_seed(0)
    model, sink, expected = TwoHeads(), MemorySink(), []
    optimizer = NoUpdate(model.parameters())
    keep = 0 if path == "hooks" else probes.KEEP_OUTPUT_ELEMENTS
    with (
        mock.patch.object(probes, "KEEP_OUTPUT_ELEMENTS", keep),
        gradtrack.watch(model, backend=sink, optimizer=optimizer, log_every=1),
    ):
        for step in range(3):
            optimizer.zero_grad()
            reached: list[torch.Tensor] = []
            for micro in range(2):
                a, b = model(torch.randn(4, 4))
                a.retain_grad()
                a.register_hook(reached.append), b.register_hook(reached.append)
                (a.pow(2).mean() + (step + micro + 1) * b.sum()).backward()
                assert a.grad is not None
            optimizer.step()
            assert a.grad is not None  # (until the next forward)
            expected.append(float(torch.cat([g.reshape(-1) for g in reached]).double().norm()))
    assert [r.output_grad_norm for r in sink.records] == pytest.approx(expected, rel=1e-6)
    assert all(r.output_finite and r.output_grad_finite for r in sink.records)
