"""A training script for the spool tests, run as its own process:

    python -m tests.sinks.spool_child TRACKING_URI STEPS {kill|close} [NAN_STEP [FREEZE_PGID]]

Trains a small model with gradtrack's defaults (log_every=10) against MLflow at
TRACKING_URI; then either dies at once by SIGKILL (no close, no exit hooks: a process the
OOM killer or a scheduler ended) or closes with a short flush timeout. With FREEZE_PGID,
halfway through it waits until MLflow has every step so far, then freezes the server's
process group (SIGSTOP) for the rest of the run. Prints "trained".
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
    freeze = int(sys.argv[5]) if len(sys.argv) > 5 else None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    watcher = gradtrack.watch(
        model, backend="mlflow", optimizer=optimizer, flush_timeout_s=3,
        mlflow={"tracking_uri": uri, "retry_max_s": 1, "request_timeout_s": 2},
    )  # fmt: skip
    for step in range(steps):
        if freeze is not None and step == steps // 2:
            watcher.flush(timeout_s=30)
            os.killpg(freeze, signal.SIGSTOP)
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
    print(f"run {watcher.sinks[0].run_id}", flush=True)
    watcher.close()


if __name__ == "__main__":
    main()
