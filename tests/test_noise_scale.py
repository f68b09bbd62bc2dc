"""The gradient noise scale against its closed form (`tests.noise_scale_problem`): with 2 real
DDP processes (gloo) and with 4 accumulation steps in one process, within 20 % of the true
B_simple; DDP's estimate adds no collective; and where it cannot be estimated, it says why
once."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from pydantic import ValidationError

import gradtrack
from gradtrack.delivery.spool import decode, encode
from gradtrack.formats.metrics import scalar_metrics
from gradtrack.sinks import MemorySink
from gradtrack.worker.noise_scale import NoiseScale
from tests import noise_scale_problem as problem
from tests.sinks.mlflow_server import free_port


def _close(record: gradtrack.StepRecord, truth: dict[str, float]) -> None:
    assert record.noise_scale == pytest.approx(truth["noise_scale"], rel=0.2)
    assert record.noise_scale_trace == pytest.approx(truth["trace"], rel=0.2)
    assert record.noise_scale_g2 == pytest.approx(truth["g2"], rel=0.2)


def _accumulate(
    micro_batches: int, size: int, steps: int = problem.STEPS, **options: object
) -> tuple[MemorySink, torch.nn.Linear]:
    net = problem.model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    sink, data = MemorySink(), problem.batches(seed=1, size=size)
    with gradtrack.watch(net, backend=sink, optimizer=optimizer, histograms=False, **options):
        for _ in range(steps):
            optimizer.zero_grad()
            for _ in range(micro_batches):
                x, y = next(data)
                (problem.loss(net, x, y) / micro_batches).backward()
            optimizer.step()
    return sink, net


@pytest.mark.slow
def test_four_accumulation_steps_in_one_process_find_the_true_noise_scale() -> None:
    sink, net = _accumulate(micro_batches=4, size=16, log_every=1)
    _close(sink.records[-1], problem.truth(net))
    metrics = scalar_metrics(sink.records[-1])
    assert metrics["grad/noise_scale"] == sink.records[-1].noise_scale
    assert {"grad/noise_scale_trace", "grad/noise_scale_g2"} <= set(metrics)
    assert sink.records[0].noise_scale is None  # step 0: accumulation not yet seen


@pytest.mark.slow
def test_accumulation_logged_every_tenth_step_finds_it_too() -> None:
    """Backward passes are counted on the logged steps alone: the estimate needs no more."""
    sink, net = _accumulate(micro_batches=4, size=16, steps=2000, log_every=10)
    assert [r.step for r in sink.records[:3]] == [0, 10, 20]
    assert sink.records[0].noise_scale is None and sink.records[1].noise_scale is not None
    _close(sink.records[-1], problem.truth(net))


@pytest.mark.slow
def test_two_ddp_ranks_find_it_with_no_collective_of_its_own(tmp_path: Path) -> None:
    mp.start_processes(
        problem.run_ddp, args=(free_port(), 32, tmp_path), nprocs=2, start_method="spawn"
    )
    ranks = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    rank0 = ranks[0]
    records = rank0["records_True"]
    assert len(records) == problem.STEPS and "records_True" not in ranks[1]
    _close(records[-1], rank0["truth"])
    assert all(r.noise_scale is None for r in rank0["records_False"])
    # One collective per logged step (the local norms' all-gather), with or without it.
    for rank in ranks:
        assert rank["collectives_True"] == rank["collectives_False"] == problem.STEPS


def test_the_loss_scale_changes_its_parts_but_not_the_noise_scale() -> None:
    """Summing micro-batch losses instead of averaging them scales |G|² and tr(Σ) by k²."""
    averaged, _ = _accumulate(micro_batches=4, size=16, steps=200, log_every=1)
    net = problem.model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    summed, data = MemorySink(), problem.batches(seed=1, size=16)
    with gradtrack.watch(net, backend=summed, optimizer=optimizer, histograms=False, log_every=1):
        for _ in range(200):
            optimizer.zero_grad()
            for _ in range(4):
                problem.loss(net, *next(data)).backward()
            optimizer.step()
    a, s = averaged.records[-1], summed.records[-1]
    assert s.noise_scale == pytest.approx(a.noise_scale, rel=1e-6)
    assert s.noise_scale_g2 == pytest.approx(16 * a.noise_scale_g2, rel=1e-6)  # type: ignore[operator]


@pytest.mark.parametrize("asked", [{"noise_scale": True}, {"noise_scale": {"per_layer": True}}])
def test_asked_for_without_two_batch_sizes_it_says_why_once(
    caplog: pytest.LogCaptureFixture, asked: dict[str, object]
) -> None:
    with caplog.at_level(logging.INFO, logger="gradtrack"):
        sink, _ = _accumulate(micro_batches=1, size=16, steps=30, log_every=1, **asked)
    assert all(r.noise_scale is None for r in sink.records)
    said = [m for m in caplog.messages if "noise scale" in m]
    assert len(said) == 1 and "two batch sizes" in said[0]


def test_by_default_a_run_it_cannot_estimate_hears_nothing_of_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One process, one backward per step (the README's demo): nothing to say at INFO."""
    with caplog.at_level(logging.INFO, logger="gradtrack"):
        sink, _ = _accumulate(micro_batches=1, size=16, steps=30, log_every=1)
    assert all(r.noise_scale is None for r in sink.records)
    assert [m for m in caplog.messages if "noise scale" in m] == []
    assert sink.records  # (the run itself was logged)


@pytest.mark.parametrize("off", [{"noise_scale": False}, {"GRADTRACK_NOISE_SCALE": "0"}])
def test_false_switches_it_off_as_for_histograms_and_the_spool(
    monkeypatch: pytest.MonkeyPatch, off: dict[str, object]
) -> None:
    env = {k: v for k, v in off.items() if k.startswith("GRADTRACK_")}
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    options = {k: v for k, v in off.items() if k not in env}
    sink, _ = _accumulate(micro_batches=4, size=16, steps=10, log_every=1, **options)
    assert sink.records and all(r.noise_scale_g2 is None for r in sink.records)


def test_an_input_with_no_tensor_asks_for_the_batch_size(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Wrapped(torch.nn.Module):  # takes a dict: no tensor argument to count
        def __init__(self) -> None:
            super().__init__()
            self.linear = problem.model()

        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.linear(batch["x"])

    for batch_size in (None, 16):
        net = Wrapped()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
        sink, data = MemorySink(), problem.batches(seed=1, size=16)
        caplog.clear()
        options = {"batch_size": batch_size}
        with caplog.at_level(logging.INFO, logger="gradtrack"):
            with gradtrack.watch(net, backend=sink, optimizer=optimizer, log_every=1,
                                 noise_scale=options):  # fmt: skip
                for _ in range(20):
                    optimizer.zero_grad()
                    for _ in range(2):
                        x, y = next(data)
                        (0.5 * (net({"x": x}).squeeze(1) - y).pow(2).mean()).backward()
                    optimizer.step()
        said = [m for m in caplog.messages if "noise scale" in m]
        if batch_size is None:
            assert len(said) == 1 and "noise_scale={'batch_size': N}" in said[0]
            assert sink.records[-1].noise_scale_g2 is None
        else:
            assert said == [] and sink.records[-1].noise_scale_g2 is not None


def test_per_layer_and_through_the_spool() -> None:
    sink, _ = _accumulate(micro_batches=2, size=16, steps=20, log_every=5,
                          noise_scale={"per_layer": True})  # fmt: skip
    record = sink.records[-1]
    assert record.layer_noise_scales is not None and record.layer_noise_scales.shape == (1,)
    # One layer: its noise scale is the model's.
    assert record.layer_noise_scales[0] == pytest.approx(record.noise_scale)
    assert "grad_noise_scale/" in " ".join(scalar_metrics(record))
    back = decode(encode(record))
    assert isinstance(back, gradtrack.StepRecord)
    assert back.noise_scale == record.noise_scale
    np.testing.assert_array_equal(back.layer_noise_scales, record.layer_noise_scales)  # type: ignore[arg-type]


def test_a_nonfinite_step_leaves_the_averages_as_they_were() -> None:
    scale = NoiseScale(ema=0.9)
    first = scale.update(np.array([2.0]), np.array([1.5]), 8, 16)
    after = scale.update(np.array([np.nan]), np.array([np.inf]), 8, 16)
    assert after.noise_scale.tolist() == first.noise_scale.tolist() == [8.0]
    with pytest.raises(ValueError, match="b_small < b_big"):
        scale.update(np.array([2.0]), np.array([1.5]), 16, 16)


def test_bad_options_name_the_field() -> None:
    with pytest.raises(ValidationError, match=r"noise_scale\.ema"):
        gradtrack.GradtrackConfig(noise_scale={"ema": 1.0})
    with pytest.raises(ValidationError, match=r"noise_scale\.batch_size"):
        gradtrack.GradtrackConfig(noise_scale={"batch_size": 0})
