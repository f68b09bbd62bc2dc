"""A training script for the spool tests, run as its own process:

    python -m tests.sinks.spool_child TRACKING_URI STEPS {kill|close} [NAN_STEP]

Trains a small model with gradtrack's defaults (log_every=10) against MLflow at
TRACKING_URI; then either dies at once by SIGKILL (no close, no exit hooks: a process the
OOM killer or a scheduler ended) or closes with a short flush timeout. Prints "trained".
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from torch import nn

import gradtrack


def main() -> None:
    uri, steps, end = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    nan_step = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    watcher = gradtrack.watch(
        model, backend="mlflow", optimizer=optimizer, flush_timeout_s=3,
        mlflow={"tracking_uri": uri, "retry_max_s": 1, "request_timeout_s": 2},
    )  # fmt: skip
    for step in range(steps):
        optimizer.zero_grad()
        loss = model(torch.randn(16, 8)).pow(2).mean()
        if step == nan_step:
            loss = loss * float("nan")
        loss.backward()
        optimizer.step()
    watcher.flush(timeout_s=10)  # every step is in the spool (and tried once)
    print("trained", flush=True)
    if end == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    watcher.close()


if __name__ == "__main__":
    main()
