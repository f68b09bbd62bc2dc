"""Where gradtrack's cost per logged step goes: the training thread vs the worker thread.

    python -m benchmarks.step_cost [--models cnn mlp transformer] [--steps 300]
    python -m benchmarks.step_cost --defaults --backend mlflow   # gradtrack's defaults
    python -m benchmarks.step_cost --defaults --backend mlflow --config '{"layer_every": 1}'

Summaries every step into the memory sink unless told otherwise. The training-thread figure
is the wall time of gradtrack's step hook (launching reductions, the host copy, the
hand-off); the worker figure is the CPU time its thread used (records, alert rules, the
sink) — or its process, where it runs in one — from /proc (Linux). Both are per training
step, and as a share of the step's time.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import torch

import gradtrack
from benchmarks.models import MODELS


def _worker_cpu_s(watcher: Any) -> float:
    """CPU seconds the watch's worker used so far: its thread's, or its whole process's
    (``delivery.process``: the worker process, with its couriers)."""
    from gradtrack.worker.process import WorkerProcess

    worker = watcher.worker
    if isinstance(worker, WorkerProcess):
        return _cpu_s(f"/proc/{worker.pid}/stat")
    native_id = worker._thread.native_id
    assert native_id is not None
    return _cpu_s(f"/proc/self/task/{native_id}/stat")


def _cpu_s(stat: str) -> float:
    with open(stat) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(name: str, steps: int, backend: str, **options: Any) -> tuple[float, float, float]:
    """(step ms, training-thread gradtrack ms, worker CPU ms) per step."""
    torch.manual_seed(0)
    model, loss_fn = MODELS[name]()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    watcher = gradtrack.watch(model, backend, optimizer, **options)
    assert isinstance(watcher, gradtrack.Watcher)  # not switched off: its parts are timed
    hook = watcher.stepper.end  # (the hooks' `boundary` calls it)
    spent = [0.0]

    def timed() -> bool:
        start = time.perf_counter()
        skip = hook()
        spent[0] += time.perf_counter() - start
        return skip

    watcher.stepper.end = timed  # type: ignore[method-assign]

    def train(n: int) -> None:
        for _ in range(n):
            optimizer.zero_grad()
            loss_fn().backward()
            optimizer.step()
        watcher.flush()

    train(10)
    spent[0] = 0.0
    cpu, start = _worker_cpu_s(watcher), time.perf_counter()
    train(steps)
    elapsed = time.perf_counter() - start
    worker_s = _worker_cpu_s(watcher) - cpu
    watcher.close()
    return elapsed / steps * 1e3, spent[0] / steps * 1e3, worker_s / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["cnn", "mlp", "transformer"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--backend", default="memory", help="memory, mlflow (local sqlite), ...")
    parser.add_argument(
        "--defaults", action="store_true", help="gradtrack's defaults, not summaries every step"
    )
    parser.add_argument("--config", default="{}", help='more options, JSON: {"layer_every": 1}')
    args = parser.parse_args()
    options: dict[str, Any] = {} if args.defaults else {"log_every": 1, "histograms": False}
    options.update(json.loads(args.config))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; backend "
          f"{args.backend}, {options or 'defaults'}; ms per training step")  # fmt: skip
    print("model | step | gradtrack, training thread | gradtrack worker CPU")
    with tempfile.TemporaryDirectory() as directory:
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{directory}/mlflow.db")
        for name in args.models:
            step, hook, worker = measure(name, args.steps, args.backend, **options)
            print(f"{name} | {step:.2f} | {hook:.3f} ({hook / step:.1%}) | "
                  f"{worker:.3f} ({worker / step:.1%})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
