"""The training thread never reads a value back per layer: no ``.item()``, one copy per step."""

from __future__ import annotations

from collections import Counter
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradtrack
from gradtrack.sinks import MemorySink
from tests.conftest import NoUpdate, cnn_batch


class OpRecorder(TorchDispatchMode):
    """Counts every aten op the training thread runs (backward included)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.device_to_host = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.ops[func.overloadpacket.__name__] += 1
        if func.overloadpacket.__name__ in ("_to_copy", "copy_"):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            if any(t.device.type != "cpu" for t in tensors):
                self.device_to_host += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("foreach_only", [False, True], ids=["cpu_kernels", "foreach_only"])
@pytest.mark.parametrize("inject_nan", [False, True], ids=["finite", "nan"])
def test_no_host_sync_in_the_training_thread(
    cnn: nn.Module, foreach_only: bool, inject_nan: bool
) -> None:
    optimizer = NoUpdate(cnn.parameters())
    sink = MemorySink()
    watcher = gradtrack.watch(
        cnn, backend=sink, optimizer=optimizer, log_every=2, histograms={"every": 4}
    )
    watcher.collector.foreach_only = foreach_only
    recorder = OpRecorder()
    with recorder:
        for step in range(8):
            images, labels = cnn_batch(seed=step)
            optimizer.zero_grad()
            nn.functional.cross_entropy(cnn(images), labels).backward()
            if inject_nan:
                cnn[3].weight.grad[0, 0, 0, 0] = float("nan")
            optimizer.step()
    watcher.close()

    reductions = recorder.ops["_foreach_norm"] + recorder.ops["segment_reduce"]
    assert reductions >= 2 * 4  # the mode saw the collection itself
    assert recorder.ops["_local_scalar_dense"] == 0  # no .item(), bool(tensor), float(tensor)
    assert recorder.device_to_host == 0  # CPU model: nothing to copy at all
    assert watcher.host_transfers == 4  # one hand-off per logged step (steps 0, 2, 4, 6)
    assert [r.step for r in sink.records] == [0, 2, 4, 6]
    assert [r.nan_count for r in sink.records] == [int(inject_nan)] * 4
    # The default update signals ran too (sampled), with no read and no per-layer copy.
    assert all(r.update_norms is not None for r in sink.records)


def test_foreach_path_ops_per_logged_step_do_not_grow_with_the_number_of_layers() -> None:
    """On accelerators every op is a kernel launch: the count must not scale with depth
    (the default update signals included: their sample views are made at watch time).
    Nothing is handed to the worker whole there (CPU tensors only): not here either."""

    def ops_per_logged_step(depth: int) -> int:
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(depth)])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)

        def count(watched: bool) -> int:
            watcher = None
            if watched:
                watcher = gradtrack.watch(
                    model,
                    backend=MemorySink(),
                    optimizer=optimizer,
                    log_every=1,
                    histograms=False,
                )
                watcher.collector.foreach_only = True  # the path CUDA takes
            recorder = OpRecorder()
            with recorder:
                model(torch.ones(2, 8)).sum().backward()
                optimizer.step()
            if watcher is not None:
                watcher.close()
            return sum(recorder.ops.values())

        return count(True) - count(False)

    with mock.patch("gradtrack.capture.collect.DEFER_BELOW_ELEMENTS", 0):
        assert ops_per_logged_step(4) == ops_per_logged_step(64)


def test_spike_statistics_every_step_read_nothing_on_the_accelerator_path(cnn: nn.Module) -> None:
    """The default spike rule's window is updated at every step, and a spike between logged
    steps is latched on the device: no value is read back per step."""
    optimizer = NoUpdate(cnn.parameters())
    sink = MemorySink()
    watcher = gradtrack.watch(
        cnn, backend=sink, optimizer=optimizer, log_every=10, histograms=False
    )
    watcher.collector.foreach_only = True
    watcher.guard_reads_host = False  # what an accelerator does between logged steps
    recorder = OpRecorder()
    with recorder:
        for step in range(41):  # the latch reaches the host with logged step 40
            images, labels = cnn_batch(seed=step % 2)
            optimizer.zero_grad()
            nn.functional.cross_entropy(cnn(images), labels).backward()
            if step == 33:
                for param in cnn.parameters():
                    param.grad.mul_(300.0)  # type: ignore[union-attr]
            optimizer.step()
    watcher.close()
    assert recorder.ops["index_add_"] == 41  # the layer norms of every step
    assert recorder.ops["_local_scalar_dense"] == 0
    assert {e.step for e in sink.events if e.rule == "spike"} == {33}
