"""Update/weight ratios: ‖ΔW‖/‖W‖ of the update the optimizer really applied, per layer, on
logged steps (AdamW with weight decay: momentum, preconditioning and decay included)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.capture import collect
from gradtrack.capture.updates import Lattice, SampledUpdateProbe, UpdateProbe, WholeUpdateProbe
from gradtrack.formats.metrics import scalar_metrics
from gradtrack.sinks import MemorySink
from gradtrack.worker.process import WorkerProcess
from tests.conftest import SmallCNN, cnn_batch

pytestmark = pytest.mark.usefixtures("one_thread")

PROBES = {"kernels": (UpdateProbe, SampledUpdateProbe), "whole": (WholeUpdateProbe,)}


@pytest.fixture(autouse=True)
def probe(request: pytest.FixtureRequest) -> Iterator[str]:
    """How the update is measured: by the training thread's reductions ("kernels": every test
    here unless it parametrizes ``probe``), or, for a small CPU model, by the worker from two
    copies of the weights ("whole", `WholeUpdateProbe`: the default for models this small)."""
    way = getattr(request, "param", "kernels")
    bound = 0 if way == "kernels" else collect.DEFER_BELOW_ELEMENTS
    with mock.patch("gradtrack.capture.collect.DEFER_BELOW_ELEMENTS", bound):
        yield way


def layer_norms(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Each parameter-owning module's parameters, copied (fp64), by module name."""
    return {
        name: [p.detach().double().clone() for p in module.parameters(recurse=False)]
        for name, module in model.named_modules()
        if any(True for _ in module.parameters(recurse=False))
    }


def norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float((t * t).sum()) for t in tensors))


def step_ratios(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor
) -> dict[str, float]:
    """One step on ``batch``; each layer's real update ratio ‖W after − W before‖ / ‖W
    before‖, by name, measured here from copies."""
    optimizer.zero_grad()
    model(batch).pow(2).mean().backward()
    before = layer_norms(model)
    optimizer.step()
    after = layer_norms(model)
    return {
        name: norm([a - b for a, b in zip(after[name], before[name])]) / norm(before[name])
        for name in before
    }


def forty_small_layers() -> tuple[nn.Sequential, torch.optim.Optimizer]:
    """80 tensors of 4-16 elements (two shapes) and AdamW with weight decay."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(40)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def assert_ratios(sink: MemorySink, expected: dict[int, dict[str, float]], rtol: float) -> None:
    """Each record's update ratios are the ones measured at its step (`step_ratios`)."""
    for record in sink.records:
        want = np.array([expected[record.step][name] for name in record.layers])
        np.testing.assert_allclose(record.update_ratios(), want, rtol=rtol)  # type: ignore[arg-type]


def train_on_small_batches(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, layers: tuple[str, ...]
) -> dict[int, list[float]]:
    """``steps`` steps on random (4, 6) batches; per step, each of ``layers``' real update
    ratio ‖W after − W before‖ / ‖W before‖, measured here from copies."""
    expected = {}
    for step in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 6)).pow(2).mean().backward()
        before = layer_norms(model)
        optimizer.step()
        after = layer_norms(model)
        expected[step] = [
            norm([a - b for a, b in zip(after[name], before[name])]) / norm(before[name])
            for name in layers
        ]
    return expected


@pytest.mark.parametrize("probe", ["kernels", "whole"], indirect=True)
@pytest.mark.parametrize("judged_in_training_thread", [False, True], ids=["worker", "raise_rule"])
def test_update_ratio_is_the_real_adamw_update_per_layer(
    judged_in_training_thread: bool, probe: str
) -> None:
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
        assert isinstance(watcher.judge.signals.updates, PROBES[probe])
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
    probe = watcher.judge.signals.updates
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


# -- the default: ‖ΔW‖ from a sample -------------------------------------------------------------
def real_ratios(optimizer_name: str, update_signals: object) -> tuple[np.ndarray, np.ndarray]:
    """(measured by gradtrack, measured here from full copies) per logged step and layer."""
    torch.manual_seed(0)
    model = SmallCNN()
    optimizer: torch.optim.Optimizer
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sink = MemorySink()
    expected: dict[int, dict[str, float]] = {}
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, update_signals=update_signals):
        for step in range(31):
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
    got = np.array([r.update_ratios() for r in sink.records])
    want = np.array([[expected[r.step][n] for n in r.layers] for r in sink.records])
    return got, want


@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd_momentum"])
def test_the_default_estimates_each_layers_update_from_a_sample(optimizer_name: str) -> None:
    got, want = real_ratios(optimizer_name, "sampled")
    assert got.shape == (4, 3)  # logged steps 0, 10, 20, 30; layers 0, 3, 7
    # Layer 0 (448 elements) is taken whole: exact. 3 and 7 (4,640 and 20,490) from 1,024
    # elements per tensor: measured within 7% on this model; allowed 15%.
    np.testing.assert_allclose(got[:, 0], want[:, 0], rtol=1e-5)  # (fp32 differences)
    np.testing.assert_allclose(got[:, 1:], want[:, 1:], rtol=0.15)
    assert not np.allclose(got[:, 1:], want[:, 1:], rtol=1e-4)  # a sample, not a copy


@pytest.mark.parametrize("probe", ["whole"], indirect=True)
@pytest.mark.parametrize("update_signals", [True, "sampled"], ids=["exact", "sampled"])
def test_a_small_cpu_models_update_is_measured_whole_by_the_worker(update_signals: Any) -> None:
    """SmallCNN (25,600 weights) is under `DEFER_BELOW_ELEMENTS`: either way of asking, the
    training thread copies its weights before and after the step, and every layer's ratio
    is the update SGD with momentum applied, exactly (no sample)."""
    got, want = real_ratios("sgd_momentum", update_signals)
    assert got.shape == (4, 3)
    np.testing.assert_allclose(got, want, rtol=1e-5)  # (fp32 differences)


@pytest.mark.slow
@pytest.mark.parametrize("probe", ["whole"], indirect=True)
def test_the_whole_update_crosses_to_the_worker_process_into_mlflow(tmp_path: Path) -> None:
    """The embedded MLflow store runs the worker in a child process: the two copies of the
    weights travel to it and its rows reach the store."""
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with gradtrack.watch(
        model, "mlflow", optimizer=optimizer, update_signals=True, log_every=5,
        mlflow={"tracking_uri": uri}, layer_every=5,
    ) as watcher:  # fmt: skip
        assert isinstance(watcher.worker, WorkerProcess)
        assert isinstance(watcher.judge.signals.updates, WholeUpdateProbe)
        expected = train_on_small_batches(model, optimizer, 11, ("0", "2"))
    run_id = watcher.sinks[0].run_id  # (told by the child as it closed)
    client = mlflow.MlflowClient(uri)
    for i, layer in enumerate(("0", "2")):
        history = sorted(
            client.get_metric_history(run_id, f"update_ratio/{layer}"), key=lambda m: m.step
        )
        assert [m.step for m in history] == [0, 5, 10]
        np.testing.assert_allclose(
            [m.value for m in history], [expected[s][i] for s in (0, 5, 10)], rtol=1e-5
        )


def test_the_lattice_walks_across_rows_and_columns() -> None:
    lattice = Lattice(64 * 64, 32, np.random.default_rng(0), whole=False)
    assert (lattice.stride, lattice.count) == (127, 32)  # the largest prime <= 4096 / 32
    flat = torch.arange(64 * 64.0)
    picked = lattice.view(flat).long()
    assert len(picked) == 32 and picked.max() < 64 * 64
    assert len(set((picked % 64).tolist())) == 32 and len(set((picked // 64).tolist())) >= 31
    assert lattice.scale == pytest.approx(math.sqrt(128))
    assert Lattice(2048, 1024, np.random.default_rng(0), whole=False).whole  # small: all of it


def test_the_default_keeps_a_few_kib_per_tensor_and_changes_no_training() -> None:
    def run(watched: bool) -> tuple[list[torch.Tensor], dict[str, Any], torch.Tensor]:
        torch.manual_seed(0)
        model = SmallCNN()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        watcher = (
            gradtrack.watch(model, backend=MemorySink(), optimizer=optimizer) if watched else None
        )
        for step in range(21):
            images, labels = cnn_batch(seed=step)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
        if watcher is not None:
            probe = watcher.judge.signals.updates
            assert isinstance(probe, SampledUpdateProbe)
            assert probe.sample_bytes == 4 * (432 + 16 + 1024 + 32 + 1024 + 10)
            watcher.close()
        return (
            [p.detach().clone() for p in model.parameters()],
            optimizer.state_dict(),
            torch.rand(3),
        )

    watched, unwatched = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(watched[0], unwatched[0]))
    for a, b in zip(watched[1]["state"].values(), unwatched[1]["state"].values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
    assert torch.equal(watched[2], unwatched[2])  # the global RNG is untouched


def test_a_parameter_whose_data_is_replaced_is_sampled_again() -> None:
    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False)  # 4,096 elements: sampled, not taken whole
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = MemorySink()
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, log_every=1):
        for step in range(3):
            if step == 2:
                model.weight.data = model.weight.data.clone()  # a new storage
            optimizer.zero_grad()
            model(torch.randn(8, 64, generator=torch.Generator().manual_seed(step))).pow(
                2
            ).sum().backward()
            optimizer.step()
    ratios = [float(r.update_ratios()[0]) for r in sink.records]  # type: ignore[index]
    assert all(ratio > 1e-4 for ratio in ratios)  # not 0: the new storage was read


@pytest.mark.parametrize("probe", ["whole"], indirect=True)
def test_whole_copies_read_a_weight_whose_storage_is_replaced(probe: str) -> None:
    """The whole probe keeps each weight's flat view from step to step: a weight whose
    storage the user replaces (``param.data = ...``: a new tensor at step 3, a transposed,
    non-contiguous one at step 6, contiguous again at step 9) is read where it now lies, and
    every step's update is the one SGD applied."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sink = MemorySink()
    expected = {}
    with gradtrack.watch(
        model, backend=sink, optimizer=optimizer, log_every=1, update_signals=True
    ) as watcher:
        assert isinstance(watcher.judge.signals.updates, WholeUpdateProbe)
        for step in range(12):
            if step == 3:
                model[0].weight.data = model[0].weight.data.clone() * 0.5
            elif step == 6:
                model[2].weight.data = model[2].weight.data.t().contiguous().t()
                assert not model[2].weight.is_contiguous()
            elif step == 9:
                model[2].weight.data = model[2].weight.data.contiguous()
            expected[step] = train_on_small_batches(model, optimizer, 1, ("0", "2", "4"))[0]
    assert [r.step for r in sink.records] == list(range(12))
    for record in sink.records:
        ratios = record.update_ratios()
        assert ratios is not None
        np.testing.assert_allclose(ratios, expected[record.step], rtol=1e-4)


def test_without_an_optimizer_the_watching_line_says_what_is_missing_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = nn.Linear(4, 2)
    sink = MemorySink()
    with caplog.at_level("INFO", logger="gradtrack"):
        with gradtrack.watch(model, backend=sink):
            for _ in range(21):
                model(torch.ones(1, 4)).sum().backward()
    missing = [r.getMessage() for r in caplog.records if "need optimizer=" in r.getMessage()]
    assert (
        len(missing) == 1 and "update ratios and the learning-rate diagnosis are off" in missing[0]
    )
    assert all(r.update_norms is None for r in sink.records)


@pytest.mark.parametrize("signals", [True, "sampled"], ids=["exact", "sampled"])
def test_layers_of_two_dtypes_get_their_own_updates_in_their_own_order(signals: Any) -> None:
    """A float64 layer between float32 ones: the probes measure each dtype's tensors in a
    pass of their own, and the rows come back in the parameters' order."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    model[2].double()
    model.forward = lambda x: model[4](model[3](model[2](model[1](model[0](x)).double()).float()))  # type: ignore[method-assign]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sink = MemorySink()
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, update_signals=signals):
        expected = train_on_small_batches(model, optimizer, 11, ("0", "2", "4"))
    assert [r.step for r in sink.records] == [0, 10]
    for record in sink.records:
        assert record.layers == ("0", "2", "4")
        # every tensor here is small enough to be taken whole: the sample is exact too
        np.testing.assert_allclose(record.update_ratios(), expected[record.step], rtol=1e-5)  # type: ignore[arg-type]


@pytest.mark.parametrize("signals", [True, "sampled"], ids=["exact", "sampled"])
def test_many_small_layers_get_their_updates_from_one_packed_pass(signals: Any) -> None:
    """80 tensors of 4-16 elements (the CPU's per-tensor kernels cost more than their
    elements): the weights' and the updates' norms are summed packed, in fp64, and each
    layer's ratio is the update AdamW applied."""
    model, optimizer = forty_small_layers()
    sink = MemorySink()
    expected: dict[int, dict[str, float]] = {}
    with gradtrack.watch(
        model, backend=sink, optimizer=optimizer, update_signals=signals
    ) as watcher:
        probe = watcher.judge.signals.updates
        assert probe is not None and probe._packing[0] is not None  # (the packed pass)
        for step in range(21):
            expected[step] = step_ratios(model, optimizer, torch.randn(8, 4))
    assert [r.step for r in sink.records] == [0, 10, 20]
    assert_ratios(sink, expected, rtol=1e-4)


@pytest.mark.parametrize("ring", [False, True], ids=["own-copy", "shared-ring"])
@pytest.mark.parametrize("probe", ["whole"], indirect=True)
def test_whole_copies_of_many_small_weights_of_few_shapes_stack_them_by_shape(
    probe: str, ring: bool
) -> None:
    """80 small weights of two shapes are copied by one stack per shape (`ShapeGroups`), not
    one view each, into a tensor of their own or the ring a worker process reads: the copies
    read each weight where it lies now (a storage replaced at step 3, a non-contiguous one at
    step 6), and every step's ratio is the update AdamW applied."""
    from gradtrack.handoff.shared import SharedCopies

    model, optimizer = forty_small_layers()
    sink = MemorySink()
    expected: dict[int, dict[str, float]] = {}
    with gradtrack.watch(
        model, backend=sink, optimizer=optimizer, log_every=1, update_signals=True
    ) as watcher:
        updates = watcher.judge.signals.updates
        assert isinstance(updates, WholeUpdateProbe) and updates._shapes is not None
        if ring:
            watcher.collector.whole.shared = SharedCopies.create(1 << 20)
        for step in range(8):
            if step == 3:
                model[7].weight.data = model[7].weight.data.clone() * 0.5
            elif step == 6:
                model[9].weight.data = model[9].weight.data.t().contiguous().t()
                assert not model[9].weight.is_contiguous()
            expected[step] = step_ratios(model, optimizer, torch.randn(8, 4))
    assert [r.step for r in sink.records] == list(range(8))
    assert_ratios(sink, expected, rtol=1e-5)
