"""The console sink: a readable table, and never more than one per interval."""

from __future__ import annotations

import io

import torch
from torch import nn

import gradtrack
from gradtrack.sinks import ConsoleSink


def run(interval_s: float, steps: int, nan_at: int | None = None) -> str:
    stream = io.StringIO()
    torch.manual_seed(0)  # a random init whose ReLUs all die would make max |g| exactly 0
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    sink = ConsoleSink(interval_s=interval_s, stream=stream)
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, log_every=1):
        for step in range(steps):
            optimizer.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            if step == nan_at:
                model[2].bias.grad[0] = float("nan")
            optimizer.step()
    return stream.getvalue()


def test_table_lists_every_layer_with_norm_max_and_nonfinite_counts() -> None:
    lines = run(interval_s=0.0, steps=1).splitlines()
    assert lines[0].startswith("gradtrack step 0: total gradient norm ")
    assert lines[1].split() == ["layer", "numel", "norm", "max|g|", "mean|g|", "NaN", "Inf"]
    assert [line.split()[:2] for line in lines[2:]] == [["0", "20"], ["2", "5"]]


def test_max_and_mean_read_dash_on_steps_that_did_not_compute_them() -> None:
    tables = run(interval_s=0.0, steps=2).split("gradtrack step ")[1:]
    first, second = ([line.split() for line in t.splitlines()[2:]] for t in tables)
    assert all(float(row[3]) > 0 and float(row[4]) > 0 for row in first)  # layer_every: 0
    assert all(row[3:5] == ["-", "-"] and float(row[2]) > 0 for row in second)


def test_rate_limit_shows_first_first_nonfinite_and_last_step_only() -> None:
    output = run(interval_s=3600.0, steps=30, nan_at=12)
    headers = [line for line in output.splitlines() if line.startswith("gradtrack step")]
    assert [h.split(":")[0] for h in headers] == [
        "gradtrack step 0", "gradtrack step 12", "gradtrack step 29",
    ]  # fmt: skip
    assert "<- non-finite" in output
