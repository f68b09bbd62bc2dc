"""The per-layer schedule: dense early, one per window late, and a bounded extra cost."""

from __future__ import annotations

import itertools

import pytest

from gradtrack.capture.verdict import DenseEarly, extra_steps_bound, layer_schedule
from gradtrack.config import GradtrackConfig


def due_steps(schedule: object, total: int, log_every: int) -> list[int]:
    return [step for step in range(0, total, log_every) if schedule(step)]  # type: ignore[operator]


@pytest.mark.parametrize("log_every", [1, 3, 10, 25])
@pytest.mark.parametrize("every", [7, 100, 1000])
def test_extra_steps_over_fixed_windows_stay_within_the_bound(log_every: int, every: int) -> None:
    for total in (50, 1_000, 20_000, 200_000):
        logged = range(0, total, log_every)
        fixed = len({step // every for step in logged})
        dense = len(due_steps(DenseEarly(every), total, log_every))
        assert fixed <= dense <= fixed + extra_steps_bound(every)


def test_a_short_run_gets_a_column_at_every_logged_step() -> None:
    # The case: 200 steps, log_every=10, layer_every=100 gave 2 columns.
    assert len(due_steps(DenseEarly(100), 200, 10)) == 20
    assert len(due_steps(layer_schedule(GradtrackConfig(layer_every=100)), 200, 10)) == 2


def test_late_steps_are_the_fixed_windows_first_steps() -> None:
    for log_every in (1, 10, 30):
        dense = due_steps(DenseEarly(100), 50_000, log_every)
        fixed = due_steps(layer_schedule(GradtrackConfig(layer_every=100)), 50_000, log_every)
        late = [step for step in dense if step >= 32 * 100]
        assert late == [step for step in fixed if step >= 32 * 100]
        # Dense at first; never sparser than one per layer_every (plus the logging stride).
        gaps = [b - a for a, b in itertools.pairwise(dense)]
        assert max(gaps) <= 100 + log_every and gaps[0] == log_every


def test_sparser_steps_stay_on_the_denser_ones() -> None:
    # Power-of-two gaps nest: a run logged every step has every per-layer step of a run
    # logged every 4 steps, so the two can be compared wherever the sparser one has a column.
    every_1 = set(due_steps(DenseEarly(128), 20_000, 1))
    every_4 = set(due_steps(DenseEarly(128), 20_000, 4))
    assert every_4 <= every_1


def test_config_names_the_schedule_and_refuses_others() -> None:
    assert isinstance(layer_schedule(GradtrackConfig(layer_schedule="dense_early")), DenseEarly)
    with pytest.raises(ValueError, match="layer_schedule"):
        GradtrackConfig(layer_schedule="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be >= 1"):
        DenseEarly(0)


def test_a_watcher_with_the_dense_early_schedule_writes_enough_columns() -> None:
    import torch
    from torch import nn

    import gradtrack
    from gradtrack.sinks import MemorySink

    model = nn.Linear(4, 2)
    sink = MemorySink()
    with gradtrack.watch(model, backend=sink, layer_schedule="dense_early", histograms=False):
        for _ in range(200):
            model(torch.randn(3, 4)).sum().backward()
    per_layer = [r.step for r in sink.records if r.per_layer]
    assert per_layer == list(range(0, 200, 10))  # the fixed schedule: [0, 100]
