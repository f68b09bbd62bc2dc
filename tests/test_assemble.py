"""Record assembly on its own: a collected step (host copies and named evidence) in, its
`StepRecord` and alerts out — no watcher, no worker, no sink."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from torch import nn

from gradtrack.alerts import AlertEngine
from gradtrack.capture.collect import Collector
from gradtrack.capture.layers import discover_layers
from gradtrack.capture.verdict import BadStepLatch
from gradtrack.config import GradtrackConfig
from gradtrack.handoff.layout import KeptOutputs, StepEvidence
from gradtrack.handoff.mailbox import PendingStep
from gradtrack.worker.assemble import Assembler


def _parts(model: nn.Module, config: GradtrackConfig) -> tuple[Collector, Assembler]:
    collector = Collector(discover_layers(model, config), 256, seed=0)
    engine = AlertEngine(config.alerts, collector.index.layer_names)
    return collector, Assembler(collector.index, config, engine, activation_names=("act",))


def _backward(model: nn.Module) -> None:
    torch.manual_seed(0)
    model.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()


def test_a_record_holds_exact_norms_and_its_evidence_by_name() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1))
    config = GradtrackConfig(histograms={"every": 1})
    collector, assembler = _parts(model, config)
    _backward(model)
    evidence = StepEvidence(
        output_finite=torch.tensor(True),
        amp_found_inf=torch.tensor(0.0),
        amp_scale=torch.tensor(1024.0),
        amp_scale_after=torch.tensor(1024.0),
        activation_norms=[torch.tensor(2.5)],
    )
    parts = collector.collect(collector.guard(), with_samples=True, evidence=evidence)
    step = assembler.assemble(PendingStep(3, time.time(), parts, activation_order=[0]))
    (record,) = step.records
    grads = [p.grad for p in model.parameters()]
    total = torch.sqrt(sum(g.double().pow(2).sum() for g in grads))  # type: ignore[union-attr]
    assert record.step == 3
    assert record.total_norm == pytest.approx(float(total), rel=1e-7)
    assert record.layers == ("0", "2")
    assert record.output_finite is True and record.output_grad_finite is None
    assert record.amp_skipped is False and record.amp_scale == 1024.0
    assert record.activation_grad_norms == {"act": 2.5}
    assert set(record.histograms) == {"0", "2"}
    assert step.events == []


def test_host_values_pack_as_the_tensors_they_stand_for() -> None:
    """A CPU model's spike vector and flight rows may come as Python floats: packed, on the
    host or the device's way, they read back exactly as the same values given as tensors,
    wherever they fall between unknown fields and tensors."""
    spike, flight = [0.5, math.nan, 2.0], [7.0, 1.25, 3.5]

    def evidence(as_tensors: bool) -> StepEvidence:
        def piece(values: list[float]) -> torch.Tensor | list[float]:
            return torch.tensor(values, dtype=torch.float64) if as_tensors else values

        return StepEvidence(
            output_finite=torch.tensor(True),
            activation_norms=[torch.tensor(2.5)],
            spike=piece(spike),
            latch=torch.tensor([4.0, 1.0], dtype=torch.float64),
            flight=piece(flight),
        )

    layout, values = evidence(True).on_host()
    for as_tensors in (True, False):
        for packed_layout, packed in (
            evidence(as_tensors).on_host(),
            (evidence(as_tensors).layout(), evidence(as_tensors).on_device(torch.device("cpu"))),
        ):
            assert packed_layout == layout
            np.testing.assert_array_equal(np.asarray(packed, dtype=np.float64), values)
    read = layout.read(values)
    np.testing.assert_array_equal(read.spike, spike)
    assert read.flight.tolist() == flight and read.scalar("output_finite") == 1.0


@pytest.mark.parametrize("whole", [True, False], ids=["copied-whole", "rows"])
def test_a_cpu_part_packs_its_evidence_where_it_is_read(whole: bool) -> None:
    """A CPU step's evidence leaves the training thread unpacked (the worker packs it); what
    the worker reads is what the step held, though the loop changes its own output after."""
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1))
    collector, _ = _parts(model, GradtrackConfig())
    collector.whole.here = whole
    _backward(model)
    output = torch.ones(3)
    evidence = StepEvidence(spike=[0.5, 1.0, 0.0], kept_outputs=KeptOutputs([output], []))
    (part,) = collector.collect(collector.guard(), with_samples=False, evidence=evidence)
    assert part.cpu_evidence is None and part.unpacked is not None
    assert (part.flat is not None) is whole
    output.fill_(math.nan)  # (the loop reuses its tensor once the step is handed on)
    read = part.evidence()
    assert read.scalar("output_finite") == 1.0
    assert read.spike.tolist() == [0.5, 1.0, 0.0]
    assert part.unpacked is None


def test_a_nonfinite_step_is_counted_and_alerts() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1))
    collector, assembler = _parts(model, GradtrackConfig())
    _backward(model)
    model[2].weight.grad[0, 1] = float("nan")  # type: ignore[index]
    parts = collector.collect(collector.guard(), with_samples=False, evidence=StepEvidence())
    step = assembler.assemble(PendingStep(0, time.time(), parts))
    (record,) = step.records
    assert record.nan_count == 1
    assert [event.rule for event in step.events] == ["nonfinite"]
    assert step.events[0].layer == "2"


def test_a_latched_bad_step_leads_the_logged_step_it_rode_with() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1))
    collector, assembler = _parts(model, GradtrackConfig())
    latch = BadStepLatch(len(collector.params))
    _backward(model)
    model[0].bias.grad[2] = float("inf")  # type: ignore[index]
    latch.update(collector.guard(), step=7)  # the bad step between logged ones
    _backward(model)
    guard = collector.guard()
    evidence = StepEvidence(latch=latch.take(torch.device("cpu")))
    step = assembler.assemble(
        PendingStep(10, time.time(), collector.collect(guard, False, evidence))
    )
    latched, logged = step.records
    assert (latched.step, logged.step) == (7, 10)
    assert latched.counted is False and np.isinf(latched.total_norm)
    assert np.isfinite(logged.total_norm)
    first = step.events[0]
    assert (first.step, first.rule, first.layer) == (7, "nonfinite", "0")
