"""Update/weight ratios: ‖ΔW‖/‖W‖ of the update the optimizer really applied, per layer, on
logged steps (AdamW with weight decay: momentum, preconditioning and decay included)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.formats.metrics import scalar_metrics
from gradtrack.sinks import MemorySink
from tests.conftest import SmallCNN, cnn_batch

pytestmark = pytest.mark.usefixtures("one_thread")


def layer_norms(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Each parameter-owning module's parameters, copied (fp64), by module name."""
    return {
        name: [p.detach().double().clone() for p in module.parameters(recurse=False)]
        for name, module in model.named_modules()
        if any(True for _ in module.parameters(recurse=False))
    }


def norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float((t * t).sum()) for t in tensors))


@pytest.mark.parametrize("judged_in_training_thread", [False, True], ids=["worker", "raise_rule"])
def test_update_ratio_is_the_real_adamw_update_per_layer(judged_in_training_thread: bool) -> None:
    torch.manual_seed(0)
    model = SmallCNN()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sink = MemorySink()
    extra: dict[str, Any] = {}
    if judged_in_training_thread:  # the record is assembled before the update exists
        extra["alerts"] = {"exploding": {"action": "raise", "threshold": 1e12}}
    expected: dict[int, dict[str, float]] = {}
    with gradtrack.watch(
        model, backend=sink, optimizer=optimizer, update_signals=True, **extra
    ) as watcher:
        for step in range(25):  # default schedule: logged steps 0, 10, 20
            images, labels = cnn_batch(seed=step)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(images), labels).backward()
            before = layer_norms(model)
            optimizer.step()
            after = layer_norms(model)
            expected[step] = {
                name: norm([a - b for a, b in zip(after[name], before[name])]) / norm(before[name])
                for name in before
            }
    assert [r.step for r in sink.records] == [0, 10, 20]
    for record in sink.records:
        ratios = record.update_ratios()
        assert ratios is not None
        want = np.array([expected[record.step][name] for name in record.layers])
        np.testing.assert_allclose(ratios, want, rtol=1e-3)
        assert (ratios > 1e-5).all()  # AdamW moved every layer
    assert watcher.layer_names == record.layers
    metrics = scalar_metrics(sink.records[0])  # a per-layer step (layer_every)
    for layer, ratio in zip(sink.records[0].layers, sink.records[0].update_ratios()):  # type: ignore[arg-type]
        assert metrics[f"update_ratio/{layer}"] == ratio
        assert f"param_norm/{layer}" in metrics and f"update_norm/{layer}" in metrics
    assert not any(k.startswith("update_ratio/") for k in scalar_metrics(sink.records[1]))


def test_a_layer_that_learns_far_too_fast_trips_update_ratio() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(
        [
            {"params": model[0].parameters(), "lr": 1e-3},
            {"params": model[2].parameters(), "lr": 5.0},
        ]
    )
    sink = MemorySink()
    with gradtrack.watch(
        model, backend=sink, optimizer=optimizer, update_signals=True, log_every=1,
        alerts={"exploding": {"enabled": False}, "spike": {"enabled": False}},
    ):  # fmt: skip
        for step in range(5):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            if all(torch.isfinite(p).all() for p in model.parameters()):
                optimizer.step()
    events = [e for e in sink.events if e.rule == "update_ratio"]
    assert events and events[0].layer == "2" and events[0].step == 2  # patience 3
    assert "learns too fast" in events[0].message


def test_unlogged_steps_take_no_snapshot() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watcher = gradtrack.watch(model, backend=MemorySink(), optimizer=optimizer, update_signals=True)
    taken = []
    probe = watcher.stepper.signals.updates
    assert probe is not None
    original = probe.before
    probe.before = lambda: (taken.append(watcher.step - 1), original())  # type: ignore[method-assign,func-returns-value]
    for _ in range(21):
        optimizer.zero_grad()
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
    watcher.close()
    assert taken == [0, 10, 20]


def test_update_signals_need_the_optimizer() -> None:
    with pytest.raises(gradtrack.GradtrackError, match="update_signals needs optimizer="):
        gradtrack.watch(nn.Linear(2, 2), backend="memory", update_signals=True)
