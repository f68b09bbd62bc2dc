"""Where the worker's Python should run, measured (issue #39): a thread or a child process.

    python -m benchmarks.worker_place [--work-us 0 300 1500] [--rounds 3] [--steps 2000]

The tight loop of `benchmarks.fastloop` (MLP 32→64→64→4, batch 16, SGD, one torch thread)
hands its gradient norms (one ``_foreach_norm``, one host copy) every 10th step to a consumer
that spends ``--work-us`` µs of pure Python on each, as gradtrack's worker does assembling a
record, running the rules and feeding the trackers. The consumer is nobody (the hand-off
alone), a thread of the training process (it shares the GIL the training thread needs at
every op), or a child process fed by a pipe (a GIL of its own). Variants are interleaved
over the rounds; it prints each one's mean step against no hand-off at all.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import statistics
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np
import torch
from torch import nn

EVERY = 10  # a logged step in ten, gradtrack's default
WARMUP = 200


def busy(us: float) -> int:
    """Pure Python for ``us`` µs: bytecode that holds the GIL, as record assembly does."""
    end = time.perf_counter() + us / 1e6
    total = 0
    while time.perf_counter() < end:
        for i in range(50):
            total += i * i
    return total


def _thread_consumer(inbox: queue.SimpleQueue[np.ndarray | None], work_us: float) -> None:
    while inbox.get() is not None:
        busy(work_us)


def _process_consumer(conn: Connection, work_us: float) -> None:
    while conn.recv_bytes() != b"":
        busy(work_us)


def train(steps: int, hand_off: Callable[[np.ndarray], None] | None) -> float:
    """The mean step in µs (after a warm-up), handing the norms off every ``EVERY`` steps."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 32), torch.randn(16, 4)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if hand_off is not None and step % EVERY == 0:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            hand_off(torch.stack(torch._foreach_norm(grads)).numpy())
        times.append(time.perf_counter() - start)
    return statistics.mean(times[WARMUP:]) * 1e6


def run(variant: str, steps: int, work_us: float) -> float:
    if variant == "none":
        return train(steps, None)
    if variant == "hand-off only":
        return train(steps, lambda norms: None)
    if variant == "thread":
        inbox: queue.SimpleQueue[np.ndarray | None] = queue.SimpleQueue()
        consumer = threading.Thread(target=_thread_consumer, args=(inbox, work_us))
        consumer.start()
        try:
            return train(steps, inbox.put)
        finally:
            inbox.put(None)
            consumer.join()
    parent, child = mp.Pipe()
    process = mp.get_context("fork").Process(target=_process_consumer, args=(child, work_us))
    process.start()
    try:
        return train(steps, lambda norms: parent.send_bytes(norms.tobytes()))
    finally:
        parent.send_bytes(b"")
        process.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-us", type=float, nargs="+", default=[0.0, 300.0, 1500.0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    variants = ("none", "hand-off only", "thread", "child process")
    print("work per logged step | consumer | mean step (µs) | ÷ none | extra per step (µs)")
    for work_us in args.work_us:
        means: dict[str, list[float]] = {variant: [] for variant in variants}
        for _ in range(args.rounds):
            for variant in variants:
                means[variant].append(run(variant, args.steps, work_us))
        base = statistics.median(means["none"])
        for variant in variants:
            mean = statistics.median(means[variant])
            print(
                f"{work_us:.0f} µs | {variant} | {mean:.1f} | {mean / base:.2f}× | "
                f"{mean - base:+.1f}"
            )


if __name__ == "__main__":
    main()
