"""How gradtrack's cost grows with the work, and whether its memory stays flat.

    python -m benchmarks.scaling tensors      # overhead vs number of parameter tensors
    python -m benchmarks.scaling params       # overhead vs parameter count
    python -m benchmarks.scaling memory       # RSS over 20,000 logged steps, slow sink

Overheads are median step times as a ratio to no monitoring, the variants round-robin in
one process: the floor (one foreach L2 pass over every gradient) and gradtrack summaries
every step (memory sink; max and mean |g| on the ``layer_every`` steps).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

import gradtrack
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord
from gradtrack.sinks import MemorySink


def _ratio(
    make: Callable[[], tuple[nn.Module, torch.Tensor]], rounds: int, steps: int
) -> tuple[float, float, float]:
    """(base ms, floor / base, summaries / base): median step times, round-robin."""
    torch.manual_seed(0)
    template, inputs = make()
    Run = tuple[nn.Module, torch.optim.Optimizer, gradtrack.WatcherLike | None, list[float]]
    runs: dict[str, Run]
    runs = {}
    for name in ("base", "floor", "summaries"):
        model = copy.deepcopy(template)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
        watcher = None
        if name == "summaries":
            watcher = gradtrack.watch(
                model, backend=MemorySink(), optimizer=optimizer, log_every=1, histograms=False
            )
        runs[name] = (model, optimizer, watcher, [])
    for round_ in range(rounds + 1):
        for name, (net, opt, _, times) in runs.items():
            weights = list(net.parameters())
            for _ in range(steps):
                start = time.perf_counter()
                opt.zero_grad()
                net(inputs).pow(2).mean().backward()
                if name == "floor":  # one L2 pass over every gradient, one result tensor
                    grads = [w.grad for w in weights if w.grad is not None]
                    torch.stack(torch._foreach_norm(grads, 2)).double()
                opt.step()
                if round_:  # the first round warms up
                    times.append(time.perf_counter() - start)
    for _, _, watcher, _ in runs.values():
        if watcher is not None:
            watcher.close()
    base = statistics.median(runs["base"][3])
    floor, summaries = (statistics.median(runs[n][3]) / base for n in ("floor", "summaries"))
    return base * 1e3, floor, summaries


def tensors(counts: Sequence[int] = (100, 500, 1000, 2000, 5000)) -> None:
    print("parameter tensors | parameters | base ms | floor | summaries every step")
    for count in counts:

        def make(count: int = count) -> tuple[nn.Module, torch.Tensor]:
            model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(count // 2)])
            return model, torch.randn(8, 16)

        base_ms, floor, ratio = _ratio(make, rounds=15, steps=4)
        params = (count // 2) * (16 * 16 + 16)
        print(f"{count} | {params:,} | {base_ms:.1f} | {floor:.3f}x | {ratio:.3f}x", flush=True)


def params(widths: Sequence[int] = (64, 256, 1024, 2048)) -> None:
    print("width | parameters (8 Linear layers) | base ms | floor | summaries every step")
    for width in widths:

        def make(width: int = width) -> tuple[nn.Module, torch.Tensor]:
            model = nn.Sequential(*[nn.Linear(width, width) for _ in range(8)])
            return model, torch.randn(64, width)

        base_ms, floor, ratio = _ratio(make, rounds=15, steps=4)
        count = 8 * (width * width + width)
        print(f"{width} | {count:,} | {base_ms:.1f} | {floor:.3f}x | {ratio:.3f}x", flush=True)


class SlowSink:
    """Takes 2 ms per batch and keeps nothing: the queue, not the sink, holds the backlog."""

    def __init__(self) -> None:
        self.steps = 0

    def write(self, batch: Sequence[StepRecord]) -> None:
        time.sleep(0.002)
        self.steps += len(batch)

    def alert(self, event: AlertEvent) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def memory(steps: int = 20_000, queue_size: int = 64) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    sink = SlowSink()
    inputs = torch.randn(16, 32)
    watcher = gradtrack.watch(
        model, backend=sink, optimizer=optimizer, log_every=1, histograms={"every": 10},
        delivery={"queue_size": queue_size, "max_batch_steps": 1, "batch_wait_s": 0.0},
    )  # fmt: skip
    assert isinstance(watcher, gradtrack.Watcher)  # not switched off: its mailbox is read
    print("logged steps | RSS MiB | queued | dropped | delivered")
    most_queued = 0
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        model(inputs).pow(2).mean().backward()
        optimizer.step()
        most_queued = max(most_queued, watcher.mailbox._steps)
        if step % 2000 == 0:
            print(f"{step} | {rss_mib():.1f} | {watcher.mailbox._steps} | "
                  f"{watcher.dropped_steps} | {sink.steps}", flush=True)  # fmt: skip
    watcher.close()
    print(f"most steps ever queued: {most_queued} (queue_size={queue_size}); "
          f"delivered {sink.steps} + dropped {watcher.dropped_steps} = {steps}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["tensors", "params", "memory"])
    jobs: dict[str, Callable[[], None]] = {"tensors": tensors, "params": params, "memory": memory}
    jobs[parser.parse_args().what]()


if __name__ == "__main__":
    main()
