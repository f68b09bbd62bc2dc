"""The worker's Python per logged step, alone: a real run's steps replayed through its
assembler (reduction of the step's copies, the record, every alert rule), timed in one thread.

    python -m benchmarks.assemble [--models tight tiny300] [--steps 2000] [--rounds 3]

The worker (a thread of the training process for most sinks, or the child process MLflow's
goes to) pays this at every logged step: in a thread it holds the GIL the training thread
needs; in the child, past what the child can do per second, the shared ring fills and the
training process reduces the copies itself. A live run's worker CPU (`benchmarks.step_cost`)
moves with everything else the machine does; a replay of the same steps does not.

Each model (`benchmarks.fastloop.make_model`) trains ``--steps`` steps at ``log_every=1``,
its steps kept as the watch hands them to its worker, then a fresh assembler summarises
them, ``--rounds`` times; it prints each round's µs per step and the best.
"""

from __future__ import annotations

import argparse
import copy
import gc
import logging
import os
import tempfile
import time
from typing import Any

import torch
from torch import nn

import gradtrack
from benchmarks.fastloop import make_model
from gradtrack.handoff.mailbox import PendingStep
from gradtrack.sinks import MemorySink


def kept_steps(model_name: str, steps: int) -> tuple[Any, list[PendingStep]]:
    """Train ``steps`` steps watched at every step; the watch and the steps it handed on."""
    torch.manual_seed(0)
    model = make_model(model_name)
    width = 32 if model_name == "tight" else 8
    x, y = torch.randn(16, width), torch.randn(16, 4 if model_name == "tight" else 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    watcher = gradtrack.watch(model, MemorySink(), optimizer=optimizer, log_every=1)
    kept: list[Any] = []

    def keep(item: Any, records: Any, events: Any) -> None:  # (instead of assembling it)
        kept.append(item)
        if getattr(item, "reply", None) is not None:
            item.reply.answer(None)

    watcher.worker._process = keep  # type: ignore[attr-defined]
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    watcher.close()
    return watcher, [item for item in kept if isinstance(item, PendingStep)]


def replay(watcher: Any, steps: list[PendingStep]) -> float:
    """Seconds per step a fresh assembler takes over ``steps`` (each a fresh copy: reducing
    a step's copy replaces it with its rows)."""
    fresh = []
    for step in steps:
        step = copy.copy(step)
        step.parts = [copy.copy(part) for part in step.parts]
        fresh.append(step)
    assembler = watcher.plan.assembler(watcher.plan.engine(), watcher.drops)
    gc.collect()
    start = time.perf_counter()
    for step in fresh:
        assembler.assemble(step)
    return (time.perf_counter() - start) / len(fresh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["tight", "tiny300"])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("gradtrack").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    os.chdir(tempfile.mkdtemp())
    for name in args.models:
        watcher, steps = kept_steps(name, args.steps)
        rounds = [replay(watcher, steps) * 1e6 for _ in range(args.rounds)]
        each = " ".join(f"{r:.0f}" for r in rounds)
        print(f"{name}: {len(steps)} steps, µs a step per round {each}; best {min(rounds):.0f}")


if __name__ == "__main__":
    main()
