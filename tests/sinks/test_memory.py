"""The memory sink and the metric keys every sink shares."""

from __future__ import annotations

import torch
from torch import nn

import gradtrack
from gradtrack.sinks import MemorySink
from tests.conftest import NoUpdate


def test_scalars_use_the_shared_keys_and_nonfinite_keys_only_where_nonzero() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    sink = MemorySink()
    optimizer = NoUpdate(model.parameters())
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, log_every=1):
        for step in range(3):
            optimizer.zero_grad()
            model(torch.ones(2, 3)).sum().backward()
            if step == 1:
                model[0].weight.grad[0, 0] = float("nan")
                model[0].weight.grad[0, 1] = float("inf")
            optimizer.step()
    scalars = sink.scalars()
    per_layer = {
        f"{prefix}/{layer}"
        for prefix in ("grad_norm", "grad_max", "grad_mean_abs", "grad_rms")
        for layer in ("0", "2")
    }
    # With optimizer=, the default (sampled) update signals on the per-layer steps.
    per_layer |= {
        f"{prefix}/{layer}"
        for prefix in ("param_norm", "update_norm", "update_ratio")
        for layer in ("0", "2")
    }
    totals = {"grad/total_norm", "grad/nan_count", "grad/inf_count"}
    totals |= {"grad/min_layer_norm", "grad/max_layer_norm"}
    assert set(scalars) == {*totals, "grad_nan/0", "grad_inf/0", *per_layer}
    assert scalars["grad_nan/0"] == [(1, 1.0)] and scalars["grad_inf/0"] == [(1, 1.0)]
    assert scalars["grad/nan_count"] == [(0, 0.0), (1, 1.0), (2, 0.0)]
    # Per-layer series at the first step of each layer_every (default 100) window, and at
    # step 1 in full because its gradient was non-finite; the totals at every logged step.
    assert [step for step, _ in scalars["grad_norm/2"]] == [0, 1]
    record = sink.records[0]
    (weakest, low), (strongest, high) = record.extreme_layers()
    assert {weakest, strongest} == {"0", "2"} and low < high
    assert scalars["grad/min_layer_norm"][0] == (0, low)
    assert scalars["grad/max_layer_norm"][0] == (0, high)
    norms = dict(scalars["grad/total_norm"])
    assert norms[0] > 0 and norms[1] != norms[1]  # NaN at the poisoned step


def test_layer_every_windows_need_not_align_with_log_every() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    sink = MemorySink()
    optimizer = NoUpdate(model.parameters())
    with gradtrack.watch(model, sink, optimizer, log_every=3, layer_every=5, histograms=False):
        for _ in range(16):
            optimizer.zero_grad()
            model(torch.ones(2, 3)).sum().backward()
            optimizer.step()
    # Logged steps 0, 3, 6, 9, 12, 15 fall in the 5-step windows 0, 0, 1, 1, 2, 3: the first
    # logged step of each window carries the layers.
    assert [(r.step, r.per_layer) for r in sink.records] == [
        (0, True), (3, False), (6, True), (9, False), (12, True), (15, True),
    ]  # fmt: skip
    assert [step for step, _ in sink.scalars()["grad_max/0"]] == [0, 6, 12, 15]
    assert len(sink.scalars()["grad/total_norm"]) == 6


def test_only_the_first_bad_step_of_each_window_is_written_in_full() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    sink = MemorySink()
    optimizer = NoUpdate(model.parameters())
    with gradtrack.watch(model, sink, optimizer, log_every=1, layer_every=10, histograms=False):
        for step in range(25):
            optimizer.zero_grad()
            model(torch.ones(2, 3)).sum().backward()
            if step in (3, 4, 5, 10, 11, 17, 18):
                model[2].bias.grad[0] = float("nan")
            optimizer.step()
    # Window [0, 10): step 0, then the first NaN step 3 (4 and 5 are not); window [10, 20):
    # step 10, which is also its first NaN step, so 11 is not, nor 17; window [20, 30): 20.
    written = [r.step for r in sink.records if r.per_layer]
    assert written == [0, 3, 10, 20]
    assert [s for s, _ in sink.scalars()["grad_nan/2"]] == [3, 4, 5, 10, 11, 17, 18]
