"""The replay that names the module making a NaN: it finds it, and changes nothing of the
training — buffers (BatchNorm statistics), the RNG, gradients — that it replays."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.capture.origin import RNG_CHECK_EVERY, RNG_CHECKS
from gradtrack.sinks import MemorySink
from tests.test_alerts import Poison, only


class LogWhen(nn.Module):
    """log of its input at the steps it is switched on: NaN in the forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x) if self.on else x


def batchnorm_dropout_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), LogWhen(), nn.Linear(16, 1)
    )


def state(model: nn.Module) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    buffers = [b.clone() for b in model.buffers()]
    return [*grads, *buffers, torch.get_rng_state()]


def test_replay_names_the_module_and_leaves_buffers_rng_and_grads_untouched() -> None:
    model = batchnorm_dropout_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    before: list[list[torch.Tensor]] = []
    after: list[list[torch.Tensor]] = []
    optimizer.register_step_pre_hook(lambda *_: before.append(state(model)))  # before gradtrack's
    sink = MemorySink()
    with gradtrack.watch(model, backend=sink, optimizer=optimizer):
        optimizer.register_step_pre_hook(lambda *_: after.append(state(model)))  # after it
        for step in range(6):
            model[3].on = step == 3
            optimizer.zero_grad()
            model(torch.randn(32, 8)).pow(2).mean().backward()
            optimizer.step()
    (event,) = only(sink.events, "nonfinite")
    assert (event.step, event.origin_stage, event.origin_layer) == (3, "forward", "3")
    assert "forward pass at 3's output" in event.message
    for step, (was, now) in enumerate(zip(before, after)):
        assert len(was) == len(now)
        for a, b in zip(was, now):
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), step  # bit for bit


def test_a_gradient_the_model_did_not_make_is_not_pinned_on_a_module() -> None:
    """NaN written into ``.grad`` after backward: the replay stays finite and says so; the
    event falls back to the non-finite layer nearest the loss."""
    model = batchnorm_dropout_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    sink = MemorySink()
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, log_every=1):
        model(torch.randn(32, 8)).pow(2).mean().backward()
        model[0].weight.grad[0, 0] = float("nan")
        optimizer.step()
    (event,) = only(sink.events, "nonfinite")
    assert (event.origin_stage, event.origin_layer) == ("backward", "0")
    assert "The replay's backward stayed finite: the model's own forward" in event.message


def test_between_logged_steps_a_gradient_changed_after_backward_is_not_laid_on_the_loss() -> None:
    """The same, between logged steps (a unit replay): the layer nearest the output kept a
    finite gradient, so the loss did not send the NaN; the event says what else could."""
    model = batchnorm_dropout_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    sink = MemorySink()
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, log_every=10):
        for step in range(4):
            optimizer.zero_grad()
            model(torch.randn(32, 8)).pow(2).mean().backward()
            if step == 3:
                model[0].weight.grad[0, 0] = float("nan")
            optimizer.step()
    (event,) = only(sink.events, "nonfinite")
    assert (event.step, event.origin_stage, event.origin_layer) == (3, "backward", "0")
    assert "a gradient changed after backward (a hook, clipping code" in event.message


def test_a_large_output_gradient_is_not_held_and_the_event_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A language model's logits gradient can take gigabytes: past the bound (lowered here
    to 16 bytes) the probe keeps no reference, and a backward-made NaN is not pinned."""
    from tests.test_alerts import deep_model

    monkeypatch.setattr("gradtrack.capture.origin.MAX_KEPT_OUTPUT_GRAD_BYTES", 16)
    model = deep_model()
    sink = MemorySink()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradtrack.watch(model, backend=sink, optimizer=optimizer) as watcher:
        for step in range(3):
            model[3].value = float("nan") if step == 1 else None
            optimizer.zero_grad()
            model(torch.randn(32, 8)).pow(2).mean().backward()
            probe = watcher.probes.origin
            assert probe is not None and probe.output_grads() == []  # nothing held
            optimizer.step()
    event = only(sink.events, "nonfinite")[0]
    assert event.step == 1 and "not kept" in event.message


def test_a_bad_step_reads_its_flags_back_once_not_once_per_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On an accelerator each ``.cpu()`` is a wait for the device: the weights' check and
    the replay's per-module flags are read in one copy per device."""
    from gradtrack.capture.origin import _read, nonfinite_weight_layers

    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)])
    with torch.no_grad():
        model[3].weight[0, 0] = float("nan")
    params = list(model.parameters())
    reads = []
    original = torch.Tensor.cpu

    def cpu(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        reads.append(self.shape)
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    names = tuple(str(i) for i in range(5))
    tensor_layer = torch.arange(10).div(2, rounding_mode="floor").numpy()
    assert nonfinite_weight_layers(names, params, tensor_layer) == ("3",)
    assert reads == [torch.Size([10])]
    reads.clear()
    flags = [torch.tensor(True), torch.tensor(False), torch.tensor(True)]
    assert _read(flags) == [True, False, True] and reads == [torch.Size([3])]
    assert _read([]) == []


class TwoHeads(nn.Module):
    """A trunk and two heads; the loss reads only the second, whose path is poisoned."""

    def __init__(self) -> None:
        super().__init__()
        from tests.test_alerts import Poison

        torch.manual_seed(0)
        self.trunk, self.first, self.poison = nn.Linear(8, 16), nn.Linear(16, 2), Poison()
        self.second = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.first(h), self.second(self.poison(h))


def test_a_backward_nan_is_found_through_the_output_that_received_a_gradient() -> None:
    """Two outputs, the loss on the second only: the replay's backward starts from each output
    tensor's own gradient (the first received none), and names the module that made it."""
    model = TwoHeads()
    sink = MemorySink()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, log_every=1):
        for step in range(3):
            model.poison.value = float("nan") if step == 2 else None
            optimizer.zero_grad()
            _, second = model(torch.randn(32, 8))
            second.pow(2).mean().backward()
            optimizer.step()
    (event,) = only(sink.events, "nonfinite")
    assert (event.step, event.origin_stage, event.origin_layer) == (2, "backward", "poison")
    assert "unit gradient" not in event.message


class LossMade(nn.Module):
    """A small model with a `Poison` inside, whose loss `loss_made_nan` can make NaN too."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.poison = nn.Sequential(nn.Linear(8, 16), nn.Tanh()), Poison()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.poison(self.body(x)))


def loss_made_nan(output: torch.Tensor) -> torch.Tensor:
    """sqrt of a negative: a NaN loss whose gradient is NaN, the model's output finite."""
    return torch.sqrt(output - 1e3).mean()


def test_between_logged_steps_a_backward_nan_is_replayed_from_a_unit_gradient() -> None:
    """The gradient reaching the output is kept on logged steps only, until a bad step is
    seen: the first bad step between logged ones is replayed from a unit gradient at the
    output, which finds a module that makes NaN itself, and says it could not see the loss's
    part; from then on every step keeps it, and a later NaN made by the loss is named so."""
    model = LossMade()
    sink = MemorySink()
    # (no optimizer: steps end at backward, and a NaN gradient never reaches the weights)
    # (each bad step first in its window of 2 is recorded, and each is an event)
    every = {"layer_every": 2, "alerts": {"nonfinite": {"cooldown_steps": 0}}}
    with gradtrack.watch(model, backend=sink, log_every=10, config=every) as watcher:
        probe = watcher.probes.origin
        assert probe is not None
        for step in range(20):
            model.poison.value = float("nan") if step == 3 else None
            model.zero_grad()
            output = model(torch.randn(32, 8))
            (loss_made_nan(output) if step in (5, 7) else output.mean()).backward()
            assert probe._grads_kept == (step % 10 == 0 or step > 3), step
    poisoned, *lossy = only(sink.events, "nonfinite")
    assert (poisoned.step, poisoned.origin_stage) == (3, "backward")
    assert poisoned.origin_layer == "poison" and "unit gradient" in poisoned.message
    assert [(e.step, e.origin_stage) for e in lossy] == [(5, "loss"), (7, "loss")]
    assert not any("unit gradient" in e.message for e in lossy)  # (replayed exactly)


def test_a_nan_the_loss_made_between_logged_steps_is_laid_at_the_loss_door() -> None:
    """The first bad step, not logged, its NaN made by the loss: the forward and a unit
    backward stay finite, and the event names the loss, saying it was inferred (a logged
    step's exact replay sees the non-finite gradient the loss sent)."""
    model = LossMade()
    sink = MemorySink()
    with gradtrack.watch(model, backend=sink, log_every=10):
        for step in range(6):
            model.zero_grad()
            output = model(torch.randn(32, 8))
            (loss_made_nan(output) if step == 4 else output.mean()).backward()
    (event,) = only(sink.events, "nonfinite")
    assert (event.step, event.origin_stage) == (4, "loss")
    assert (
        "unit gradient at the model output too, while the step's gradient is non-finite in"
        " the layer nearest the output: most likely the loss made it" in event.message
    )


def test_the_output_gradient_is_released_when_the_next_forward_begins() -> None:
    """The probe has autograd keep the output's gradient for a replay on logged steps:
    readable after the optimizer step, as a user's own ``retain_grad`` is, and released when
    the next forward begins, so that it never adds to the peak memory of a forward and
    backward. Steps between logged ones keep nothing."""
    model = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    outputs = []
    with gradtrack.watch(model, backend=MemorySink(), optimizer=optimizer, log_every=2):
        for step in range(5):
            optimizer.zero_grad()
            outputs.append(model(torch.randn(16, 8)))
            if len(outputs) > 1 and outputs[-2].retains_grad:
                assert outputs[-2].grad is None  # released as this forward began
            outputs[-1].pow(2).mean().backward()
            optimizer.step()
            if step % 2:
                assert not outputs[-1].retains_grad  # not logged: nothing kept
            else:
                assert outputs[-1].grad is not None and outputs[-1].grad.shape == (16, 1)


def test_the_cpu_generator_is_kept_only_once_a_forward_draws_from_it() -> None:
    """Its state is compared before and after the first forwards and one in
    `RNG_CHECK_EVERY`: a model that draws nothing pays no copy of it at the others; dropout
    switched on later is seen at the next check, and the state is kept from then on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.0), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    kept = []
    with gradtrack.watch(model, backend=MemorySink(), optimizer=optimizer) as watcher:
        probe = watcher.stepper.probes.origin
        assert probe is not None
        for step in range(RNG_CHECK_EVERY + 20):
            if step == 100:
                model[1].p = 0.5  # (p=0 draws nothing)
            optimizer.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            kept.append(probe._rng is not None)
            optimizer.step()
    checked = RNG_CHECK_EVERY - 1  # (the step of the 256th forward)
    assert all(kept[:RNG_CHECKS]) and not any(kept[RNG_CHECKS:checked])
    assert all(kept[checked:]) and probe.draws


def test_a_model_that_draws_nothing_is_replayed_without_its_generator_state() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), LogWhen(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    sink = MemorySink()
    with gradtrack.watch(model, backend=sink, optimizer=optimizer):
        for step in range(40):
            model[2].on = step == 33  # (a forward whose generator state was not kept)
            optimizer.zero_grad()
            model(torch.randn(32, 8)).pow(2).mean().backward()
            optimizer.step()
    (event,) = only(sink.events, "nonfinite")
    assert (event.step, event.origin_stage, event.origin_layer) == (33, "forward", "2")
