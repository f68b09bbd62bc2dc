"""torch.distributed: 2 real processes on the gloo backend (CPU) against one process.

DDP and FSDP2 (`fully_shard`, sharded DTensor gradients) train the model of
`tests.distributed_workers` on two halves of each batch; the reference trains it on the
whole batch in this process. Rank 0's records must equal the reference's statistics.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from gradtrack.formats.histogram import bin_samples
from gradtrack.formats.metrics import scalar_metrics
from tests import distributed_workers as workers
from tests.conftest import assert_record_matches, reference_stats
from tests.sinks.mlflow_server import free_port

LAYERS = ("0", "2", "4")
ROOT = Path(__file__).resolve().parents[1]


def _launch(case: workers.Case, tmp_path: Path) -> list[dict[str, Any]]:
    mp.start_processes(
        workers.run,
        args=(case, free_port(), tmp_path),
        nprocs=case.world,
        start_method="spawn",
    )
    results = []
    for rank in range(case.world):
        with (tmp_path / f"rank{rank}.pkl").open("rb") as f:
            results.append(pickle.load(f))
    return results


def _reference(
    batch_rows: slice | None = None, steps: int = workers.STEPS
) -> list[dict[str, dict[str, float]]]:
    """Per logged step, the statistics of one process training on the whole batch (or on
    ``batch_rows`` of it)."""
    model = workers.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    for step in range(steps):
        x, y = workers.global_batch(step)
        if batch_rows is not None:
            x, y = x[batch_rows], y[batch_rows]
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if step % workers.LOG_EVERY == 0:
            expected.append(
                {
                    name: reference_stats(p.grad for p in model[int(name)].parameters())
                    for name in LAYERS
                }
            )
        optimizer.step()
    return expected


@pytest.mark.parametrize("with_optimizer", [True, False], ids=["optimizer", "backward"])
@pytest.mark.slow
def test_ddp_rank0_writes_the_synchronized_gradient(tmp_path: Path, with_optimizer: bool) -> None:
    rank0, rank1 = _launch(workers.Case("ddp", with_optimizer=with_optimizer), tmp_path)

    assert rank0["layer_names"] == LAYERS  # the model's names, not "module.0"
    assert (rank0["n_sinks"], rank1["n_sinks"]) == (1, 0)
    records = rank0["records"]
    assert [r.step for r in records] == workers.LOGGED_STEPS
    for record, expected in zip(records, _reference()):
        assert_record_matches(record, expected, rtol=1e-5)
        assert record.nonfinite_ranks == ()
        assert record.rank_grad_norms is None
    # One collective per logged step, on every rank, and none on the other steps.
    logged = [int(s % workers.LOG_EVERY == 0) for s in range(workers.STEPS)]
    assert rank0["collectives_per_step"] == rank1["collectives_per_step"] == logged


@pytest.mark.slow
def test_ranks_left_uncoordinated_each_write_with_no_collective(tmp_path: Path) -> None:
    case = workers.Case("ddp", options={"distributed": {"enabled": False}})
    results = _launch(case, tmp_path)

    for result in results:  # both ranks write the (same) synchronized gradient
        assert result["n_sinks"] == 1
        assert result["collectives_per_step"] == [0] * workers.STEPS
        for record, expected in zip(result["records"], _reference()):
            assert_record_matches(record, expected, rtol=1e-5)
            assert record.nonfinite_ranks is None


@pytest.mark.slow
def test_ddp_nan_on_one_rank_is_named_in_the_alert(tmp_path: Path) -> None:
    rank0, rank1 = _launch(workers.Case("ddp", nan_on_rank=1), tmp_path)

    last = rank0["records"][-1]
    assert last.step == workers.STEPS - 1
    assert last.nan_count > 0  # the all-reduce spread rank 1's NaN to every rank
    assert last.nonfinite_ranks == (1,)
    events = [e for e in rank0["events"] if e.rule == "nonfinite"]
    assert len(events) == 1
    assert events[0].ranks == (1,)
    assert "rank(s) 1 only" in events[0].message
    assert rank1["events"] == []  # rank 0 alerts; the others only report to it
    # The flight recorder kept the all-reduced norms the guard judged, every step's: at the
    # logged steps they equal rank 0's records of the synchronized gradient.
    (window,) = [r.flight for r in rank0["records"] if r.flight is not None]
    assert window.steps.tolist() == list(range(workers.STEPS))
    assert np.isnan(window.norms[-1]).all()
    for record in rank0["records"][:-1]:
        row = window.norms[window.steps.tolist().index(record.step)]
        logged = dict(zip(record.layers, record.column("norm").tolist()))
        np.testing.assert_allclose(row, [logged[layer] for layer in window.layers], rtol=1e-6)


@pytest.mark.parametrize(("layout", "bad_rank"), [("ddp", 1), ("fsdp2", 0)])
@pytest.mark.slow
def test_a_raise_rule_stops_every_rank_at_the_same_step(
    tmp_path: Path, layout: str, bad_rank: int
) -> None:
    raising = {"alerts": {"nonfinite": {"action": "raise"}}}
    results = _launch(workers.Case(layout, nan_on_rank=bad_rank, options=raising), tmp_path)

    last = workers.STEPS - 1
    for result in results:  # each rank raised, before its optimizer applied the NaN
        ((step, event),) = result["raised"]
        assert (step, event.rule) == (last, "nonfinite")
        assert event.step == last
    assert results[0]["raised"][0][1] == results[1]["raised"][0][1]  # rank 0's event


@pytest.mark.slow
def test_ddp_gather_ranks_writes_each_ranks_local_norms(tmp_path: Path) -> None:
    rank0, _ = _launch(workers.Case("ddp", gather_ranks=True), tmp_path)

    first = rank0["records"][0]
    assert first.rank_grad_norms is not None
    assert first.rank_grad_norms.shape == (workers.RANKS, len(LAYERS))
    metrics = scalar_metrics(first)
    for rank in range(workers.RANKS):
        local = _reference(workers.rank_slice(rank), steps=1)[0]
        for layer in LAYERS:
            np.testing.assert_allclose(
                metrics[f"grad_norm_rank{rank}/{layer}"], local[layer]["norm"], rtol=1e-6
            )
    # Each rank's local norm differs from the synchronized one, which is their average's.
    assert not np.allclose(first.rank_grad_norms[0], first.rank_grad_norms[1])


@pytest.mark.slow
def test_fsdp2_statistics_of_the_full_gradient_from_shards(tmp_path: Path) -> None:
    rank0, rank1 = _launch(workers.Case("fsdp2"), tmp_path)

    assert (rank0["n_sinks"], rank1["n_sinks"]) == (1, 0)
    records = rank0["records"]
    assert [r.step for r in records] == workers.LOGGED_STEPS
    for record, expected in zip(records, _reference()):
        assert_record_matches(record, expected, rtol=1e-5)
    logged = [int(s % workers.LOG_EVERY == 0) for s in range(workers.STEPS)]
    assert rank0["collectives_per_step"] == rank1["collectives_per_step"] == logged


@pytest.mark.slow
def test_fsdp2_nan_counts_are_summed_over_shards(tmp_path: Path) -> None:
    rank0, _ = _launch(workers.Case("fsdp2", nan_on_rank=0), tmp_path)

    last = rank0["records"][-1]
    # The NaN input poisons every gradient element after the reduce-scatter: all counted.
    np.testing.assert_array_equal(last.column("nan"), last.column("numel"))
    assert [e.rule for e in rank0["events"]] == ["nonfinite"]


def _torchrun(tmp_path: Path, nprocs: int, example: str, *args: str) -> str:
    """Run ``examples/<example>`` under torchrun on ``nprocs`` CPU processes; its stdout.
    (torchrun as torch's module: a reused torch's ``torchrun`` script is beside the
    interpreter that installed it, not in the venv.)"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs),
         "--master_port", str(free_port()), str(ROOT / "examples" / example), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_ddp_example_runs_under_torchrun(tmp_path: Path) -> None:
    stdout = _torchrun(tmp_path, 2, "ddp.py", "--steps", "30", "--backend", "console")
    assert "grad/total_norm" in stdout or "total" in stdout, stdout[-2000:]
    assert "rank 1" not in stdout  # one table, from rank 0


@pytest.mark.slow
def test_fsdp2_without_a_step_boundary_is_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(mp.ProcessRaisedException, match="needs optimizer="):
        _launch(workers.Case("fsdp2", with_optimizer=False), tmp_path)


# -- any device mesh: 4 ranks -----------------------------------------------------------------
MESH_LOGGED = [s for s in range(workers.STEPS) if s % workers.LOG_EVERY == 0]


def _assert_full_gradient_statistics(rank0: dict[str, Any], others: list[dict[str, Any]]) -> None:
    """Rank 0's records equal the full gradients' (fp64 via ``full_tensor()``) at every
    logged step, metric by metric; the other ranks write nothing; one collective per logged
    step and none on the others, on every rank."""
    records = rank0["records"]
    assert [r.step for r in records] == MESH_LOGGED
    for record, expected in zip(records, rank0["expected"]):
        assert_record_matches(record, expected, rtol=1e-6)
        metrics = scalar_metrics(record)
        for layer, stats in expected.items():
            np.testing.assert_allclose(metrics[f"grad_norm/{layer}"], stats["norm"], rtol=1e-6)
            np.testing.assert_allclose(metrics[f"grad_max/{layer}"], stats["max_abs"], rtol=1e-6)
            np.testing.assert_allclose(
                metrics[f"grad_mean_abs/{layer}"], stats["mean_abs"], rtol=1e-6
            )
        total = np.sqrt(sum(stats["norm"] ** 2 for stats in expected.values()))
        np.testing.assert_allclose(metrics["grad/total_norm"], total, rtol=1e-6)
    assert rank0["n_sinks"] == 1
    assert [result["n_sinks"] for result in others] == [0] * len(others)
    logged = [int(s % workers.LOG_EVERY == 0) for s in range(workers.STEPS)]
    for result in (rank0, *others):
        assert result["collectives_per_step"] == logged


@pytest.mark.slow
def test_fsdp2_over_tensor_parallel_gives_the_full_gradients_statistics(tmp_path: Path) -> None:
    # (dp=2, tp=2): up Colwise, down Rowwise, the whole model fully_shard-ed over dp, so the
    # placements are (_StridedShard, Shard), (Shard, Shard), (Shard, Replicate), and the
    # norm's (Shard,) on each tp rank's own dp sub-mesh: every piece counted once.
    histograms = {"histograms": {"every": workers.LOG_EVERY, "sample_size": 10_000}}
    rank0, *others = _launch(workers.Case("fsdp_tp", options=histograms), tmp_path)

    _assert_full_gradient_statistics(rank0, others)
    # A sample as large as the layer is the whole gradient, each element once, from the
    # ranks that own it: the histogram of the full gradient.
    for record, full in zip(rank0["records"], rank0["full_grads"]):
        for layer, values in full.items():
            expected = bin_samples(values.numpy(), record.histograms[layer].counts.size)
            assert expected is not None
            np.testing.assert_array_equal(record.histograms[layer].counts, expected.counts)
            np.testing.assert_allclose(record.histograms[layer].edges, expected.edges)


@pytest.mark.slow
def test_hsdp_gives_the_full_gradients_statistics(tmp_path: Path) -> None:
    # (replicate=2, shard=2): each piece is held twice; the replicas must not count double.
    histograms = {"histograms": {"every": workers.LOG_EVERY, "sample_size": 9}}
    rank0, *others = _launch(workers.Case("hsdp", options=histograms), tmp_path)

    _assert_full_gradient_statistics(rank0, others)
    for record in rank0["records"]:  # 9 of each layer's elements, drawn over its shards
        assert {h.sample_size for h in record.histograms.values()} == {9}
        assert set(record.histograms) == set(workers.MESH_LAYERS)


@pytest.mark.slow
def test_partial_gradients_are_refused_clearly_and_training_goes_on(tmp_path: Path) -> None:
    # SequenceParallel: the norm's weights are Replicate, their gradients Partial(sum).
    rank0, *_ = _launch(workers.Case("sp"), tmp_path)

    assert rank0["records"] == []
    (warning,) = [m for m in rank0["told"] if "gradtrack" in m]  # once, on its logger
    assert "layer 'norm'" in warning and "Partial(sum)" in warning
    assert "supported: Shard, _StridedShard" in warning
    assert len(rank0["collectives_per_step"]) == workers.STEPS  # every step trained


@pytest.mark.slow
def test_tensor_parallel_alone_gives_the_full_gradients_statistics(tmp_path: Path) -> None:
    # tp=4: down's bias Replicate, the norm a plain parameter (rank 0's copy counts).
    rank0, *others = _launch(workers.Case("tp"), tmp_path)

    _assert_full_gradient_statistics(rank0, others)
    # No gradient travels: at watch, a key and a size per tensor and the rank's coordinate;
    # per logged step 5 numbers per tensor, 2 flags and the latched bad step (its number and
    # a norm per tensor) (6 tensors, 215 elements), and on the histogram step (0) each
    # rank's share of the samples, padded to the largest: rank 0's 53 owned elements (the
    # plain norm's 12, down's replicated bias 5, its quarter of up's 84 and of down's weight
    # 60), all drawn as the default sample exceeds the layers.
    tensors = 6
    per_step = 5 * tensors + 2 + (1 + tensors)
    assert rank0["elements_sent"] == [2 * tensors + 1, per_step + 53, per_step, per_step]


@pytest.mark.slow
def test_a_nan_on_one_rank_of_a_mesh_is_attributed_to_it(tmp_path: Path) -> None:
    rank0, *_ = _launch(workers.Case("hsdp", nan_on_rank=3), tmp_path)

    last = rank0["records"][-1]
    assert last.step == workers.STEPS - 1
    assert last.nan_count > 0  # the reduce-scatter spread rank 3's NaN to every shard
    assert last.nonfinite_ranks == (3,)
    assert last.nonfinite_rank_places == ("3 (replicate=1, shard=1)",)
    (event,) = [e for e in rank0["events"] if e.rule == "nonfinite"]
    assert event.ranks == (3,)
    assert "rank(s) 3 (replicate=1, shard=1)" in event.message


@pytest.mark.slow
def test_fsdp2_over_tensor_parallel_example_runs_under_torchrun(tmp_path: Path) -> None:
    stdout = _torchrun(tmp_path, 4, "tp_fsdp.py", "--steps", "3", "--log-every", "2")
    assert stdout.count("gradtrack step") == 2, stdout[-2000:]  # steps 0 and 2, rank 0 only
    assert "(dp=2, tp=2) mesh" in stdout
