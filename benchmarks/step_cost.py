"""Where gradtrack's cost per logged step goes: the training thread vs the worker thread.

    python -m benchmarks.step_cost [--models cnn mlp transformer] [--steps 300]

Summaries every step into the memory sink. The training-thread figure is the wall time of
gradtrack's step hook (launching reductions, the host copy, the hand-off); the worker figure
is the CPU time its thread used (records, alert rules, the sink), from /proc (Linux).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import gradtrack
from benchmarks.models import MODELS


def _thread_cpu_s(native_id: int) -> float:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(name: str, steps: int) -> tuple[float, float, float]:
    """(step ms, training-thread gradtrack ms, worker CPU ms) per step."""
    torch.manual_seed(0)
    model, loss_fn = MODELS[name]()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    watcher = gradtrack.watch(model, "memory", optimizer, log_every=1, hist_every=None)
    hook = watcher._step_boundary
    spent = [0.0]

    def timed() -> None:
        start = time.perf_counter()
        hook()
        spent[0] += time.perf_counter() - start

    watcher._step_boundary = timed  # type: ignore[method-assign]

    def train(n: int) -> None:
        for _ in range(n):
            optimizer.zero_grad()
            loss_fn().backward()
            optimizer.step()
        watcher.flush()

    train(10)
    spent[0] = 0.0
    worker = watcher.worker._thread.native_id
    assert worker is not None
    cpu, start = _thread_cpu_s(worker), time.perf_counter()
    train(steps)
    elapsed = time.perf_counter() - start
    worker_s = _thread_cpu_s(worker) - cpu
    watcher.close()
    return elapsed / steps * 1e3, spent[0] / steps * 1e3, worker_s / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["cnn", "mlp", "transformer"])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per logged step")
    print("model | step | gradtrack, training thread | gradtrack worker CPU")
    for name in args.models:
        step, hook, worker = measure(name, args.steps)
        print(f"{name} | {step:.2f} | {hook:.3f} ({hook / step:.1%}) | {worker:.3f}")


if __name__ == "__main__":
    main()
