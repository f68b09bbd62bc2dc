"""Code the DeepSpeed tests run in each of their two worker processes (gloo, CPU).

Every rank trains the same MLP under a real ``deepspeed.initialize`` engine (ZeRO stage 0-3,
gradient accumulation over 2 micro-batches, a torch SGD optimizer), on its own micro-batches.
At each accumulation boundary it takes the reference — ``safe_get_full_grad`` per layer (a
collective, so outside the counted span) and, after ``engine.step()``, DeepSpeed's own
``get_global_grad_norm()`` — and counts the collectives each step issued. Rank 0 pickles its
memory sink's records and events; every rank its references and counts.
"""

from __future__ import annotations

import os
import pickle
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.conftest import reference_stats

STEPS = 6
ACCUMULATE = 2
LAYERS = ("0", "2", "4")
# Every collective DeepSpeed's torch backend and gradtrack call, looked up at call time.
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_to_all_single",
    "broadcast_object_list",
    "all_gather_object",
    "barrier",
)


@dataclass
class Case:
    stage: int
    watch: str = "engine"  # "engine", "module" (engine.module, no optimizer=), "off"
    optimizer: str = "none"  # "none", "engine", "wrapper" (engine.optimizer)
    nan_at: tuple[int, int] | None = None  # (step, rank): layer "2"'s gradient made NaN
    options: dict[str, Any] = field(default_factory=dict)


class Counter:
    """Counts collectives while ``on``."""

    def __init__(self) -> None:
        self.calls = 0
        self.on = False
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._counting(original))

    def _counting(self, original: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                self.calls += 1
            return original(*args, **kwargs)

        return counted


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # Odd sizes: ZeRO's partitions split tensors across the two ranks.
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 3))


def micro_batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, 5, generator=generator), torch.randn(4, 3, generator=generator)


def run(rank: int, case: Case, port: int, out: Path) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        DS_ACCELERATOR="cpu",
    )
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    import gradtrack
    from gradtrack.sinks.memory import MemorySink

    counter = Counter()
    deepspeed.init_distributed(dist_backend="gloo")
    model = make_model()
    if case.nan_at is not None:
        bad_step, bad_rank = case.nan_at
        current = {"step": 0}

        def poison(grad: torch.Tensor) -> torch.Tensor:
            if current["step"] == bad_step and rank == bad_rank:
                return grad * float("nan")
            return grad

        model[2].weight.register_hook(poison)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": ACCUMULATE,
        "zero_optimization": {"stage": case.stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    sink = MemorySink()
    watcher, refused = None, None
    if case.watch != "off":
        given = {"none": None, "engine": engine, "wrapper": engine.optimizer}[case.optimizer]
        try:
            watcher = gradtrack.watch(
                engine if case.watch == "engine" else engine.module,
                backend=sink,
                optimizer=given,
                histograms=False,
                layer_every=1,
                **{"log_every": 1, **case.options},
            )
        except gradtrack.GradtrackError as exc:  # training goes on, unwatched
            refused = str(exc)
    references: list[dict[str, dict[str, float]]] = []
    ds_norms: list[float] = []
    collectives: list[int] = []
    for step in range(STEPS):
        if case.nan_at is not None:
            current["step"] = step
        counted = 0
        for micro in range(ACCUMULATE):
            x, y = micro_batch(step, micro, rank)
            counter.calls, counter.on = 0, True
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            counter.on = False
            counted += counter.calls
            if micro == ACCUMULATE - 1:  # the boundary: the gradient the optimizer applies
                modules = dict(engine.module.named_modules())
                references.append(
                    {
                        name: reference_stats(
                            safe_get_full_grad(p) for p in modules[name].parameters()
                        )
                        for name in LAYERS
                    }
                )
            counter.calls, counter.on = 0, True
            engine.step()
            counter.on = False
            counted += counter.calls
        collectives.append(counted)
        norm = engine.get_global_grad_norm()
        ds_norms.append(float(norm) if norm is not None else float("nan"))
    if watcher is not None:
        watcher.close()
    result = {
        "records": sink.records,
        "events": sink.events,
        "references": references,
        "ds_norms": ds_norms,
        "collectives": collectives,
        "n_sinks": 0 if watcher is None else len(watcher.sinks),
        "refused": refused,
        # After close the engine's optimizer has its own step again (no wrapper left).
        "step_wrapped": "step" in vars(engine.optimizer),
        "layer_names": None if watcher is None else watcher.layer_names,
    }
    with (out / f"rank{rank}.pkl").open("wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()
    # The results are on disk. DeepSpeed's CPU communication (its shm op and gloo's threads)
    # has been seen to abort in its C++ destructors at interpreter exit on a loaded machine
    # ("terminate called without an active exception", once in CI): leave without them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
