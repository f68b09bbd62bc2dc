"""torch.compile: compiled before or after watching, the statistics are those of eager mode.

Real inductor compilation on the CPU (gcc). Each case also checks that watching adds no
graph break and no recompilation per step: gradtrack's forward probes do nothing inside a
compiled graph (documented in the README), its statistics come from ``.grad`` outside it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch._dynamo
from torch import nn

import gradtrack
from gradtrack.sinks.memory import MemorySink
from gradtrack.watcher import watcher_of
from tests.conftest import assert_record_matches, reference_stats

STEPS = 7


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 3))


def _train(
    wrap: Callable[[nn.Module], tuple[nn.Module, gradtrack.Watcher]],
) -> tuple[list[dict[str, dict[str, float]]], MemorySink]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    run_model, watcher = wrap(model)
    generator = torch.Generator().manual_seed(3)
    expected = []
    with watcher:
        for step in range(STEPS):
            optimizer.zero_grad()
            x = torch.randn(16, 8, generator=generator)
            run_model(x).pow(2).mean().backward()
            if step % 2 == 0:
                expected.append(
                    {
                        name: reference_stats(p.grad for p in model[int(name)].parameters())
                        for name in ("0", "2", "3")
                    }
                )
            optimizer.step()
    sink = watcher.sinks[0]
    assert isinstance(sink, MemorySink)
    return expected, sink


def _watch(model: nn.Module) -> gradtrack.Watcher:
    return gradtrack.watch(model, backend="memory", log_every=2)


def _compile_then_watch(model: nn.Module) -> tuple[nn.Module, gradtrack.Watcher]:
    compiled = torch.compile(model)
    return compiled, _watch(compiled)


def _watch_then_compile(model: nn.Module) -> tuple[nn.Module, gradtrack.Watcher]:
    watcher = _watch(model)
    return torch.compile(model), watcher


def _watch_then_module_compile(model: nn.Module) -> tuple[nn.Module, gradtrack.Watcher]:
    watcher = _watch(model)
    model.compile()
    return model, watcher


@pytest.mark.parametrize(
    "wrap", [_compile_then_watch, _watch_then_compile, _watch_then_module_compile]
)
@pytest.mark.slow
def test_compiled_model_statistics_equal_eager_reference(
    wrap: Callable[[nn.Module], tuple[nn.Module, gradtrack.Watcher]],
) -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    expected, sink = _train(wrap)

    # Layer names are the model's own, not "_orig_mod.0": keys match an eager run.
    assert [record.step for record in sink.records] == [0, 2, 4, 6]
    for record, reference in zip(sink.records, expected):
        assert_record_matches(record, reference, rtol=1e-5)
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compiled_and_plain_model_are_one_watch() -> None:
    model = _model()
    compiled = torch.compile(model)
    with gradtrack.watch(compiled, backend="memory"):
        with pytest.raises(gradtrack.GradtrackError, match="already watched"):
            gradtrack.watch(model, backend="memory")
    assert watcher_of(model) is None


@pytest.mark.slow
def test_activations_lost_to_a_later_compile_are_warned_about_once() -> None:
    torch._dynamo.reset()
    model = _model()
    x = torch.randn(4, 8)
    with gradtrack.watch(model, backend="memory", log_every=1, activations=True) as watcher:
        model(x).sum().backward()  # eager: activation gradients arrive
        compiled = torch.compile(model)
        with pytest.warns(RuntimeWarning, match="compiled after gradtrack.watch"):
            compiled(x).sum().backward()
        compiled(x).sum().backward()  # only once
    sink = watcher.sinks[0]
    assert isinstance(sink, MemorySink)
    assert sink.records[0].activation_grad_norms
    assert not sink.records[1].activation_grad_norms
    assert len(sink.records) == 3
