"""Accelerate: ``gradtrack.watch`` on what ``accelerator.prepare`` returns (a real
``Accelerator`` on the CPU), with ``accelerator.accumulate``: one record per step Accelerate
syncs, of the gradient its optimizer then applies."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")
from accelerate import Accelerator

import gradtrack
from gradtrack.sinks.memory import MemorySink
from tests.conftest import assert_record_matches, reference_stats

ACCUMULATE = 3
BATCHES = 12


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    xs = torch.randn(BATCHES, 4, 6, generator=generator)
    return [(x, x.sum(dim=1, keepdim=True)) for x in xs]


def test_prepared_model_and_optimizer_under_accumulate() -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    plain = _model()
    model, optimizer = accelerator.prepare(plain, torch.optim.Adam(plain.parameters(), lr=1e-3))
    sink = MemorySink()
    seen: list[dict[str, dict[str, float]]] = []
    with gradtrack.watch(model, sink, optimizer=optimizer, log_every=1, histograms=False):
        for x, y in _batches():
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:  # the reference: what this step applies
                    seen.append(
                        {
                            name: reference_stats(p.grad for p in model[int(name)].parameters())
                            for name in ("0", "2")
                        }
                    )
                optimizer.step()  # a no-op between syncs, as Accelerate makes it
                optimizer.zero_grad()

    # One record per step Accelerate synced (12 micro-batches / 3), not per micro-batch.
    assert len(seen) == BATCHES // ACCUMULATE
    assert [r.step for r in sink.records] == list(range(BATCHES // ACCUMULATE))
    for record, expected in zip(sink.records, seen):
        assert_record_matches(record, expected)
    # The optimizer inside Accelerate's wrapper was watched: its updates were measured.
    ratios = [r.update_ratios() for r in sink.records]
    assert all(r is not None and (r > 0).all() for r in ratios), ratios
