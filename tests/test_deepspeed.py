"""DeepSpeed: a real ``deepspeed.initialize`` engine in 2 gloo processes on the CPU.

Under ZeRO 1-3 every ``p.grad`` is None after ``engine.backward``: gradtrack reads the ZeRO
optimizer's partitions. The reference is DeepSpeed's own: ``safe_get_full_grad`` per layer
and ``engine.get_global_grad_norm()`` (the norm it clips with) at every step.
"""

from __future__ import annotations

import importlib.util
import math
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.multiprocessing as mp

from tests import deepspeed_workers as workers
from tests.conftest import assert_record_matches
from tests.sinks.mlflow_server import free_port

# Found, not imported: deepspeed is imported only in the worker processes.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs gradtrack[deepspeed]"
)


def _launch(case: workers.Case, tmp_path: Path) -> list[dict[str, Any]]:
    mp.start_processes(
        workers.run, args=(case, free_port(), tmp_path), nprocs=2, start_method="spawn"
    )
    return [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_statistics_are_those_of_the_gradient_the_optimizer_applies(
    tmp_path: Path, stage: int
) -> None:
    rank0, rank1 = _launch(workers.Case(stage), tmp_path)

    assert rank0["layer_names"] == workers.LAYERS  # the model's names, not "module.0"
    assert (rank0["n_sinks"], rank1["n_sinks"]) == (1, 0)
    records = rank0["records"]
    # One record per optimizer step: accumulation windows, as DeepSpeed counts steps.
    assert [r.step for r in records] == list(range(workers.STEPS))
    for record, expected in zip(records, rank0["references"]):
        assert_record_matches(record, expected, rtol=1e-5)
    if stage > 0:  # (stage 0 with a torch optimizer does not compute it)
        totals = [r.total_norm for r in records]
        np.testing.assert_allclose(totals, rank0["ds_norms"], rtol=1e-5)
    assert rank0["references"] == rank1["references"]  # the same full gradient on both
    assert not rank0["step_wrapped"] and not rank1["step_wrapped"]


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "given"), [(2, "wrapper"), (3, "none")])
def test_zero_steps_with_the_engines_optimizer_or_none_given(
    tmp_path: Path, stage: int, given: str
) -> None:
    """``watch(engine.module)`` with ``optimizer=engine.optimizer`` (the ZeRO wrapper, no
    torch optimizer), or under ZeRO-3 with no ``optimizer=`` at all (its parameters link to
    their optimizer): the same steps and totals as DeepSpeed's."""
    rank0, _ = _launch(workers.Case(stage, watch="module", optimizer=given), tmp_path)

    records = rank0["records"]
    assert [r.step for r in records] == list(range(workers.STEPS))
    np.testing.assert_allclose([r.total_norm for r in records], rank0["ds_norms"], rtol=1e-5)


@pytest.mark.slow
def test_zero_2_without_the_engine_is_refused_with_the_fix(tmp_path: Path) -> None:
    rank0, rank1 = _launch(workers.Case(2, watch="module", optimizer="none"), tmp_path)

    for rank in (rank0, rank1):
        assert "gradtrack.watch(engine" in rank["refused"]
        assert len(rank["ds_norms"]) == workers.STEPS  # training went on


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_a_logged_zero_step_costs_at_most_one_collective_more(tmp_path: Path, stage: int) -> None:
    """Collectives per step with gradtrack at ``log_every=1`` against DeepSpeed alone: one
    all-gather of every rank's partition statistics, no more."""
    (tmp_path / "watched").mkdir()
    (tmp_path / "alone").mkdir()
    watched, _ = _launch(workers.Case(stage), tmp_path / "watched")
    alone, _ = _launch(workers.Case(stage, watch="off"), tmp_path / "alone")

    extra = np.array(watched["collectives"]) - np.array(alone["collectives"])
    assert extra.tolist() == [1] * workers.STEPS, (watched["collectives"], alone["collectives"])


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "log_every"), [(2, 1), (3, 1), (2, 4), (3, 4)])
def test_a_nan_made_in_one_layer_on_one_rank_is_named(
    tmp_path: Path, stage: int, log_every: int
) -> None:
    """Layer 2's gradient made NaN on rank 1 at step 3: the reduced gradient's NaN lies in
    both ranks' partitions of it; gradtrack names the layer and the step — summarised in full
    where step 3 is logged, or latched by each rank on its own (no collective) and combined in
    the next logged step's one all-gather (``log_every=4``: step 4). DeepSpeed itself skips the
    step (its norm is inf), so the NaN is gone by step 4."""
    case = workers.Case(stage, nan_at=(3, 1), options={"log_every": log_every})
    rank0, _ = _launch(case, tmp_path)

    events = [e for e in rank0["events"] if e.rule == "nonfinite"]
    assert events, [e.rule for e in rank0["events"]]
    first = events[0]
    assert (first.step, first.layer) == (3, "2"), first.message
    record = next(r for r in rank0["records"] if r.step == 3)
    assert math.isnan(record.total_norm)
    norms = dict(zip(record.layers, record.column("norm")))
    assert math.isnan(norms["2"])
    if log_every == 1:  # summarised in full: its elements counted
        stats = record.layer_stats()
        assert stats["2"].nan == 49 and stats["0"].nan == 0  # all of its 7 x 7 weights
        assert math.isfinite(norms["0"])
    else:  # latched: the norms, every layer's exact where every rank latched step 3
        assert record.counted is False
        assert [r.step for r in rank0["records"]] == [0, 3, 4]
        # Both ranks hold a piece of layer 2, so both latched step 3: layer 0's norm is its
        # full gradient's, combined from the two ranks' pieces.
        expected = rank0["references"][3]["0"]["norm"]
        assert norms["0"] == pytest.approx(expected, rel=1e-5)
        ds_norm_4 = rank0["ds_norms"][4]
        assert next(r for r in rank0["records"] if r.step == 4).total_norm == pytest.approx(
            ds_norm_4, rel=1e-5
        )
