"""Code the distributed tests run in each of their worker processes (gloo, CPU).

Every rank trains the same model on its own slice of one global batch; rank 0 pickles what
its memory sink received, and every rank how many collectives gradtrack's steps issued.
The single-process reference trains the same model on the whole batch.
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradtrack
from gradtrack.capture.distributed import RankGroup, is_dtensor
from gradtrack.sinks.memory import MemorySink
from tests.conftest import reference_stats, reported

RANKS = 2
PER_RANK = 6
STEPS = 5
LOG_EVERY = 2
LOGGED_STEPS = [s for s in range(STEPS) if s % LOG_EVERY == 0]


def make_model() -> nn.Module:
    # Odd sizes: FSDP2 shards 7 rows over 2 ranks unevenly (4 + 3), 3 rows as 2 + 1.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 3))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(RANKS * PER_RANK, 5, generator=generator)
    return x, torch.randn(RANKS * PER_RANK, 3, generator=generator)


def rank_slice(rank: int) -> slice:
    return slice(rank * PER_RANK, (rank + 1) * PER_RANK)


@dataclass
class Case:
    layout: str  # "ddp", "fsdp2", or one of `MESH_LAYOUTS` (4 ranks)
    with_optimizer: bool = True
    nan_on_rank: int | None = None  # this rank's last batch gets a NaN
    gather_ranks: bool = False
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return MESH_RANKS if self.layout in MESH_LAYOUTS else RANKS


def run(rank: int, case: Case, port: int, out: Path) -> None:
    """torch.multiprocessing entry point: ``rank`` is given by `start_processes`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=case.world)
    try:
        result = _train_on_mesh(rank, case) if case.layout in MESH_LAYOUTS else _train(rank, case)
        with (out / f"rank{rank}.pkl").open("wb") as f:
            pickle.dump(result, f)
        # Both ranks done with every collective before either tears gloo down (a rank that
        # destroys its group while the other still talks to it can abort in C++).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _train(rank: int, case: Case) -> dict[str, Any]:
    model = make_model()
    if case.layout == "ddp":
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        wrapped = fully_shard(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    collectives = _count_collectives()
    events: list[gradtrack.AlertEvent] = []
    options = dict(case.options)
    distributed = {"gather_ranks": case.gather_ranks, **options.pop("distributed", {})}
    watcher = gradtrack.watch(
        wrapped,
        backend="memory",
        optimizer=optimizer if case.with_optimizer else None,
        log_every=LOG_EVERY,
        histograms=False,
        on_alert=events.append,
        distributed=distributed,
        **options,
    )
    per_step = []
    raised: list[tuple[int, gradtrack.AlertEvent]] = []
    with watcher:
        for step in range(STEPS):
            x, y = global_batch(step)
            x, y = _poisoned(case, rank, step, x[rank_slice(rank)]), y[rank_slice(rank)]
            before = collectives["count"]
            optimizer.zero_grad()
            nn.functional.mse_loss(wrapped(x), y).backward()
            if case.with_optimizer:
                try:
                    optimizer.step()
                except gradtrack.GradientAlertError as error:
                    raised.append((step, error.event))
                    break
            else:
                with torch.no_grad():
                    for p in wrapped.parameters():
                        p -= 0.1 * p.grad
            per_step.append(collectives["count"] - before)
    sink_records = []
    if watcher.sinks:
        sink = watcher.sinks[0]
        assert isinstance(sink, MemorySink)
        sink_records = sink.records
    return {
        "records": sink_records,
        "events": events,
        "n_sinks": len(watcher.sinks),
        "collectives_per_step": per_step,
        "raised": raised,
        "layer_names": watcher.layer_names,
    }


def _poisoned(case: Case, rank: int, step: int, x: torch.Tensor) -> torch.Tensor:
    """``x``, with a NaN on ``case.nan_on_rank``'s last step."""
    if case.nan_on_rank != rank or step != STEPS - 1:
        return x
    x = x.clone()
    x[0, 0] = float("nan")
    return x


def _count_collectives() -> dict[str, Any]:
    """Count gradtrack's collectives: `RankGroup.all_gather` is the only one it issues. The
    wrapper counts them, notes how many elements each rank sent, and calls through to the
    real all-gather."""
    counter: dict[str, Any] = {"count": 0, "sent": []}
    real: Callable[..., Any] = RankGroup.all_gather

    def counted(self: RankGroup, local: torch.Tensor) -> torch.Tensor:
        counter["count"] += 1
        counter["sent"].append(local.numel())
        return real(self, local)

    RankGroup.all_gather = counted  # type: ignore[method-assign]
    return counter


# -- 4 ranks on a 2-D device mesh ------------------------------------------------------------
MESH_RANKS = 4
MESH_LAYOUTS = ("fsdp_tp", "hsdp", "tp", "sp")
MESH_LAYERS = ("norm", "up", "down")


class MeshModel(nn.Module):
    """A LayerNorm (no tensor parallel: FSDP2 alone, or plain), then ``up``/``down`` Linears
    for Colwise/Rowwise parallel. ``up``'s 12 features split evenly over tp (Rowwise parallel
    needs that); ``down``'s 5 rows over dp are 3 + 2, uneven."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(6)
        self.up = nn.Linear(6, 12)
        self.down = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(self.norm(x))))


def mesh_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 6, generator=generator), torch.randn(rows, 5, generator=generator)


def _parallelize(layout: str) -> tuple[nn.Module, int, int]:
    """The model on ``layout``'s mesh; this rank's data-parallel index and their number."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    model = MeshModel()
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    if layout == "sp":  # the norm's weights get Partial(sum) gradients: refused
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        sequence_parallel = {
            "norm": SequenceParallel(sequence_dim=0),  # each tp rank its own rows
            "up": ColwiseParallel(input_layouts=Shard(0)),
            "down": RowwiseParallel(output_layouts=Shard(0)),
        }
        parallelize_module(model, mesh["tp"], sequence_parallel)
        return model, mesh.get_coordinate()[1], 2  # type: ignore[index]
    if layout == "tp":
        mesh = init_device_mesh("cpu", (MESH_RANKS,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, plan)  # every rank sees the whole batch
        return model, 0, 1
    # fp32 reductions, so that the statistics compare with the fp64 reference closely.
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    if layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
        return model, mesh.get_coordinate()[0], 2  # type: ignore[index]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=mesh, mp_policy=policy)  # HSDP: replicate x shard
    return model, dist.get_rank(), MESH_RANKS


def _train_on_mesh(rank: int, case: Case) -> dict[str, Any]:
    """Train `MeshModel` on ``case.layout``'s mesh; rank 0 also keeps, per logged step, the
    full gradients' statistics from ``full_tensor()`` (the test's reference only)."""
    model, replica, replicas = _parallelize(case.layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    collectives = _count_collectives()
    watcher = gradtrack.watch(
        model, backend="memory", optimizer=optimizer, log_every=LOG_EVERY, layer_every=1,
        on_alert=(events := []).append, **case.options,
    )  # fmt: skip
    per_step, expected, full_grads = [], [], []
    with watcher, warnings.catch_warnings(record=True) as warned, reported() as told:
        warnings.simplefilter("always")
        for step in range(STEPS):
            x, y = (t[rank_slice(replica)] for t in mesh_batch(step, replicas * PER_RANK))
            x = _poisoned(case, rank, step, x)
            before = collectives["count"]
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if step % LOG_EVERY == 0:  # every rank takes part in full_tensor's collectives
                grads = {
                    name: [_full(p.grad) for p in getattr(model, name).parameters()]
                    for name in MESH_LAYERS
                }
                expected.append({name: reference_stats(g) for name, g in grads.items()})
                full_grads.append(
                    {name: torch.cat([g.reshape(-1) for g in v]) for name, v in grads.items()}
                )
            optimizer.step()
            per_step.append(collectives["count"] - before)
    sink = watcher.sinks[0] if watcher.sinks else None
    return {
        "records": sink.records if isinstance(sink, MemorySink) else [],
        "events": events,
        "n_sinks": len(watcher.sinks),
        "collectives_per_step": per_step,
        "expected": expected,
        "full_grads": full_grads,
        "warnings": [str(w.message) for w in warned],
        "told": told,
        "elements_sent": collectives["sent"],
    }


def _full(grad: torch.Tensor | None) -> torch.Tensor:
    assert grad is not None
    full = grad.full_tensor() if is_dtensor(grad) else grad  # type: ignore[attr-defined]
    return full.detach().double()
