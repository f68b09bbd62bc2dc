"""``action="skip"``: a bad step leaves weights and optimizer state bit-identical, training
goes on, and the journal names the step (with the default schedule, ``log_every=10``)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.capture.skip import read_journal
from gradtrack.errors import GradientAlertError
from gradtrack.formats.metrics import scalar_metrics
from gradtrack.sinks import MemorySink

Optimizers = Callable[[nn.Module], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Optimizers] = {
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def model_and_batch() -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)
    )

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
        return x, x[:, :1].sin()

    return model, batch


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        value.clone()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


class Run:
    """A training loop; ``poison(step)`` may spoil a step's gradients after backward. Before
    and after each optimizer step the weights and optimizer state are kept for comparison."""

    def __init__(self, optimizer: str, tmp_path: Path, steps: int, **overrides: Any) -> None:
        self.model, self.batch = model_and_batch()
        self.optimizer = OPTIMIZERS[optimizer](self.model)
        self.sink = MemorySink()
        self.journal = tmp_path / "skipped_steps.json"
        self.watcher = gradtrack.watch(
            self.model, backend=self.sink, optimizer=self.optimizer,
            skip={"journal": self.journal}, **overrides,
        )  # fmt: skip
        self.steps = steps
        self.losses: list[float] = []
        self.before: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.after: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def snapshot(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        weights = [p.detach().clone() for p in self.model.parameters()]
        return weights, optimizer_state(self.optimizer)

    def train(self, poison: Callable[[int, nn.Module], None]) -> Run:
        with self.watcher:
            for step in range(self.steps):
                x, y = self.batch(step)
                self.optimizer.zero_grad()
                loss = nn.functional.mse_loss(self.model(x), y)
                loss.backward()
                poison(step, self.model)
                self.before[step] = self.snapshot()
                self.optimizer.step()
                self.after[step] = self.snapshot()
                self.losses.append(float(loss.detach()))
        return self

    def unchanged(self, step: int) -> bool:
        (w0, s0), (w1, s1) = self.before[step], self.after[step]
        return same(w0, w1) and same(s0, s1)


def watch_skipping(
    model: nn.Module, optimizer: torch.optim.Optimizer, journal: Path, **skip: Any
) -> gradtrack.Watcher:
    """A watcher whose nonfinite rule skips, journaling to ``journal``."""
    return gradtrack.watch(
        model, backend=MemorySink(), optimizer=optimizer,
        alerts={"nonfinite": {"action": "skip"}}, skip={"journal": journal, **skip},
    )  # fmt: skip


def nan_at(*steps: int) -> Callable[[int, nn.Module], None]:
    def poison(step: int, model: nn.Module) -> None:
        if step in steps:
            model[2].weight.grad[0, 0] = float("nan")  # type: ignore[index]

    return poison


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_nan_at_an_unlogged_step_is_skipped_bit_for_bit(optimizer: str, tmp_path: Path) -> None:
    run = Run(optimizer, tmp_path, 40, alerts={"nonfinite": {"action": "skip"}})
    run.train(nan_at(13))  # default schedule: logged steps 0, 10, 20, 30
    assert run.unchanged(13)  # weights, momentum / moments and step counts: bit-identical
    assert not run.unchanged(12) and not run.unchanged(14)  # the others did train
    assert all(torch.isfinite(p).all() for p in run.model.parameters())
    assert all(torch.isfinite(torch.tensor(loss)) for loss in run.losses)
    assert run.losses[-1] < run.losses[0]
    (entry,) = read_journal(run.journal)
    assert (entry["step"], entry["rule"], entry["layer"], entry["micro_batches"]) == (
        13, "nonfinite", "2", [13],
    )  # fmt: skip
    (event,) = [e for e in run.sink.events if e.rule == "nonfinite"]
    assert event.step == 13 and "optimizer step was skipped" in event.message
    skipped = {r.step: scalar_metrics(r).get("grad/skipped") for r in run.sink.records}
    assert skipped == {0: None, 10: None, 13: 1.0, 20: 1.0, 30: 1.0}


def test_every_skipped_step_is_an_event_despite_the_cooldown(tmp_path: Path) -> None:
    run = Run("sgd_momentum", tmp_path, 30, alerts={"nonfinite": {"action": "skip"}})
    run.train(nan_at(13, 17))
    assert run.unchanged(13) and run.unchanged(17)
    assert [e.step for e in run.sink.events if e.rule == "nonfinite"] == [13, 17]
    assert [e["step"] for e in read_journal(run.journal)] == [13, 17]


def test_consecutive_skips_escalate_to_raise(tmp_path: Path) -> None:
    model, batch = model_and_batch()
    optimizer = OPTIMIZERS["adamw"](model)
    journal = tmp_path / "journal.json"
    watcher = watch_skipping(model, optimizer, journal, max_consecutive=3)
    raised_at = None
    with watcher:
        for step in range(20):
            x, y = batch(step)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            nan_at(*range(5, 20))(step, model)
            before = [p.detach().clone() for p in model.parameters()]
            try:
                optimizer.step()
            except GradientAlertError as error:
                raised_at = step
                assert error.event.statistic == "consecutive_skips"
                assert "skip.max_consecutive=3" in error.event.message
                assert same(before, [p.detach() for p in model.parameters()])
                break
    assert raised_at == 8  # steps 5, 6, 7 skipped; the fourth in a row raises
    assert [e["step"] for e in read_journal(journal)] == [5, 6, 7]


def test_a_spike_and_an_exploding_step_are_skipped(tmp_path: Path) -> None:
    def spoil(step: int, model: nn.Module) -> None:
        if step in (60, 70):
            for param in model.parameters():
                param.grad.mul_(300.0 if step == 60 else 1e6)  # type: ignore[union-attr]

    run = Run(
        "sgd_momentum", tmp_path, 80,
        alerts={"spike": {"action": "skip"}, "exploding": {"action": "skip", "threshold": 1e3}},
    )  # fmt: skip
    run.train(spoil)
    entries = read_journal(run.journal)
    assert [(e["step"], e["rule"]) for e in entries] == [(60, "spike"), (70, "spike")]
    assert run.unchanged(60) and run.unchanged(70)
    assert sum(run.unchanged(s) for s in range(80)) == 2


def test_exploding_skip_names_the_rule(tmp_path: Path) -> None:
    def spoil(step: int, model: nn.Module) -> None:
        if step == 5:  # within the spike rule's warm-up: only exploding can see it
            for param in model.parameters():
                param.grad.mul_(1e6)  # type: ignore[union-attr]

    run = Run("adamw", tmp_path, 12, alerts={"exploding": {"action": "skip"}})
    run.train(spoil)
    assert [(e["step"], e["rule"]) for e in read_journal(run.journal)] == [(5, "exploding")]
    assert run.unchanged(5)


def test_micro_batches_of_a_skipped_step_with_gradient_accumulation(tmp_path: Path) -> None:
    model, batch = model_and_batch()
    optimizer = OPTIMIZERS["sgd_momentum"](model)
    journal = tmp_path / "skipped_steps.json"
    watcher = watch_skipping(model, optimizer, journal)
    with watcher:
        for step in range(6):
            optimizer.zero_grad()
            for micro in range(4):
                x, y = batch(4 * step + micro)
                nn.functional.mse_loss(model(x), y).backward()
            with torch.no_grad():
                model(x)  # an evaluation forward is no micro-batch
            nan_at(3)(step, model)
            optimizer.step()
    (entry,) = read_journal(journal)
    assert (entry["step"], entry["micro_batches"]) == (3, [12, 13, 14, 15])


def test_skip_is_refused_where_it_cannot_act() -> None:
    with pytest.raises(gradtrack.GradtrackError, match=r"vanishing.action = 'skip'.*nonfinite"):
        gradtrack.watch(nn.Linear(2, 2), alerts={"vanishing": {"action": "skip"}})
    with pytest.raises(gradtrack.GradtrackError, match="needs optimizer="):
        gradtrack.watch(nn.Linear(2, 2), alerts={"nonfinite": {"action": "skip"}})
    model = nn.Linear(2, 2)
    with pytest.raises(gradtrack.GradtrackError, match="without scaler="):
        gradtrack.watch(
            model, optimizer=torch.optim.SGD(model.parameters()),
            alerts={"spike": {"action": "skip"}}, scaler=torch.amp.GradScaler("cpu"),
        )  # fmt: skip


def test_the_step_wrapper_leaves_no_trace_and_works_under_an_lr_scheduler(tmp_path: Path) -> None:
    model, batch = model_and_batch()
    optimizer = OPTIMIZERS["sgd_momentum"](model)
    reference = copy.deepcopy(model)
    with watch_skipping(model, optimizer, tmp_path / "j.json"):
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)  # wraps step too
        for step in range(4):
            x, y = batch(step)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            scheduler.step()
    assert scheduler.last_epoch == 4
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    fresh = OPTIMIZERS["sgd_momentum"](reference)
    watch_skipping(reference, fresh, tmp_path / "k.json").close()
    assert "step" not in vars(fresh)  # closed: the optimizer's own step again
