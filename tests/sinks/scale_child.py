"""A training script for the delivery-at-scale tests, run as its own process (a cold start:
MLflow imported and its store created only here):

    python -m tests.sinks.scale_child TRACKING_URI STEPS PROGRESS_FILE

Trains a small MLP in a tight loop (no sleep) with gradtrack at ``log_every=1`` and the
default histograms, appending "step wall_time" to PROGRESS_FILE after every optimizer step,
then closes. A test may SIGKILL it at any point. Prints "closed" and the run's id.
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

import gradtrack


def main() -> None:
    uri, steps, progress = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the loop holds one core of the two (one rank per core)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    watcher = gradtrack.watch(
        model, backend="mlflow", optimizer=optimizer, log_every=1,
        mlflow={"tracking_uri": uri, "run_name": "scale"},
    )  # fmt: skip
    started = time.monotonic()
    with open(progress, "a", buffering=1) as out:  # a line each step, in the OS at once
        for step in range(steps):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            out.write(f"{step} {time.time():.3f}\n")
    trained = time.monotonic() - started
    watcher.close()
    closed = time.monotonic() - started - trained
    print(f"closed run {watcher.sinks[0].run_id} trained {trained:.1f}s close {closed:.1f}s")


if __name__ == "__main__":
    main()
