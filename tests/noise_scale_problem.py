"""A problem whose gradient noise scale has a closed form, for the noise-scale tests.

Linear regression ``y = x·w* + ε`` with ``x ~ N(0, I_d)`` and ``ε ~ N(0, σ²)``, loss
``½ (x·w − y)²`` averaged over the batch. At weights ``w`` with ``u = w − w*`` the
per-example gradient is ``g = x (x·u − ε)``, so ``G = E[g] = u`` and, by the Gaussian fourth
moment ``E[(x·u)² x xᵀ] = |u|² I + 2 u uᵀ``:

    tr(Σ) = E|g|² − |G|² = (d + 2)|u|² + d σ² − |u|² = (d + 1)|u|² + d σ²

The learning rate is 0: the weights, and so the true values, hold still at every step.

Also the code each DDP test process runs (gloo, CPU): every rank draws its own batches.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradtrack
from gradtrack.sinks.memory import MemorySink

D, NOISE_VARIANCE = 16, 2.0
STEPS = 1000


def model() -> nn.Linear:
    """``w = w* + u`` with ``w* = 0`` and ``|u|² = 1``."""
    linear = nn.Linear(D, 1, bias=False)
    with torch.no_grad():
        linear.weight.fill_(1 / D**0.5)
    return linear


def truth(linear: nn.Linear) -> dict[str, float]:
    u2 = float(linear.weight.detach().square().sum())
    trace = (D + 1) * u2 + D * NOISE_VARIANCE
    return {"g2": u2, "trace": trace, "noise_scale": trace / u2}


def batches(seed: int, size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(size, D, generator=generator)
        yield x, torch.randn(size, generator=generator) * NOISE_VARIANCE**0.5


def loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * (net(x).squeeze(1) - y).pow(2).mean()


# -- the DDP processes --------------------------------------------------------------------
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_gather_object", "broadcast",
    "broadcast_object_list", "reduce_scatter_tensor", "reduce", "gather", "scatter", "barrier",
)  # fmt: skip


def count_collectives() -> dict[str, int]:
    """Count every torch.distributed collective called from Python (gradtrack's; DDP's own
    all-reduce runs in its C++ reducer and is not counted)."""
    counter = {"count": 0}

    def counted(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counter["count"] += 1
            return real(*args, **kwargs)

        return call

    for name in COLLECTIVES:
        if hasattr(dist, name):  # (all_gather_single: torch 2.13's new name)
            setattr(dist, name, counted(getattr(dist, name)))
    return counter


def run_ddp(rank: int, port: int, per_rank: int, out: Path) -> None:
    """torch.multiprocessing entry point: one DDP rank trains with the noise scale on, then
    off, counting the collectives each run's steps issue."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        counter = count_collectives()
        result: dict[str, Any] = {}
        for enabled in (True, False):
            net = nn.parallel.DistributedDataParallel(model())
            optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
            data = batches(seed=10 + rank, size=per_rank)
            watch = {"log_every": 1, "histograms": False, "noise_scale": {"enabled": enabled}}
            before = counter["count"]
            with gradtrack.watch(net, backend="memory", optimizer=optimizer, **watch) as w:
                for _ in range(STEPS):
                    x, y = next(data)
                    optimizer.zero_grad()
                    loss(net, x, y).backward()
                    optimizer.step()
            result[f"collectives_{enabled}"] = counter["count"] - before
            if w.sinks:
                sink = w.sinks[0]
                assert isinstance(sink, MemorySink)
                result[f"records_{enabled}"] = sink.records
        result["truth"] = truth(net.module)
        with (out / f"rank{rank}.pkl").open("wb") as f:
            pickle.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
