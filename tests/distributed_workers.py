"""Code the distributed tests run in each of their worker processes (gloo, CPU).

Every rank trains the same model on its own slice of one global batch; rank 0 pickles what
its memory sink received, and every rank how many collectives gradtrack's steps issued.
The single-process reference trains the same model on the whole batch.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradtrack
from gradtrack.distributed import RankGroup
from gradtrack.sinks.memory import MemorySink

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
    layout: str  # "ddp" or "fsdp2"
    with_optimizer: bool = True
    nan_on_rank: int | None = None  # this rank's last batch gets a NaN
    gather_ranks: bool = False
    options: dict[str, Any] = field(default_factory=dict)


def run(rank: int, case: Case, port: int, out: Path) -> None:
    """torch.multiprocessing entry point: ``rank`` is given by `start_processes`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        result = _train(rank, case)
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
        hist_every=None,
        on_alert=events.append,
        distributed=distributed,
        **options,
    )
    per_step = []
    raised: list[tuple[int, gradtrack.AlertEvent]] = []
    with watcher:
        for step in range(STEPS):
            x, y = global_batch(step)
            x, y = x[rank_slice(rank)], y[rank_slice(rank)]
            if case.nan_on_rank == rank and step == STEPS - 1:
                x = x.clone()
                x[0, 0] = float("nan")
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


def _count_collectives() -> dict[str, int]:
    """Count gradtrack's collectives: `RankGroup.all_gather` is the only one it issues. The
    wrapper counts and calls through to the real all-gather."""
    counter = {"count": 0}
    real: Callable[..., Any] = RankGroup.all_gather

    def counted(self: RankGroup, local: torch.Tensor) -> torch.Tensor:
        counter["count"] += 1
        return real(self, local)

    RankGroup.all_gather = counted  # type: ignore[method-assign]
    return counter
