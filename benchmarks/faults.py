"""Steps stored through a tracker's faults, and what the fault costs the training loop.

    python -m benchmarks.faults [--steps 1200] [--pace-ms 25] [--faults FAULT ...]

For each fault, a fresh real `mlflow server` (sqlite store, loopback) and a small model
trained for ``--steps`` steps at ``--pace-ms`` per step (0: as fast as the loop runs), with
gradtrack logging every step. At a quarter of the run the fault begins:

- freeze: the server is stopped with SIGSTOP for 15 s, then resumed;
- kill: the server is killed, and started again on the same store 5 s later;
- late: the server is not running at the start, and starts 10 s into the run;
- locked: no server: the embedded sqlite store, locked by another process for 15 s;
- slow: a second sink beside MLflow takes 50 ms per write for the whole run.

Reported: steps stored / steps logged (each step counted once; duplicates reported apart),
gradtrack's dropped count, and the median training-step time (forward, backward, optimizer
step and gradtrack's hook; not the pace's sleep) during the fault and outside it — their
ratio is what the fault costs the loop (1.00: nothing) — beside the same model's unwatched
step. (For "slow" the fault is the whole run: "outside" is then NaN and the unwatched step
is the comparison.)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gradtrack
from gradtrack.formats.record import StepRecord
from gradtrack.sinks import MemorySink, MlflowSink
from tests.sinks.mlflow_server import MlflowServer, lock_sqlite


class SlowSink(MemorySink):
    def write(self, batch: Sequence[StepRecord]) -> None:
        time.sleep(0.05)
        super().write(batch)


FAULTS: dict[str, tuple[Callable[[MlflowServer], None] | None, bool]] = {
    "freeze": (lambda server: server.freeze(15.0), True),
    "kill": (lambda server: server.restart(5.0), True),
    "late": (lambda server: server.start_after(10.0), False),
    "locked": (lambda server: lock_sqlite(Path(server.backend_store_uri[10:]), 15.0), False),
    "slow": (None, True),
}


def run(fault: str, steps: int, pace_s: float, root: Path) -> dict[str, Any]:
    inject, running = FAULTS[fault]
    server = MlflowServer(f"sqlite:///{root / 'mlflow.db'}", root)
    embedded = fault == "locked"  # the default store, no server: MLflow's own client writes it
    uri = server.backend_store_uri if embedded else server.uri
    if running:
        server.start()
    model = nn.Linear(64, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    backends: list[Any] = ["mlflow"] + ([SlowSink()] if fault == "slow" else [])
    baseline = [_timed_step(model, optimizer) for _ in range(200)]  # unwatched
    step_s: list[float] = []
    start_at = steps // 4 if running or embedded else 0
    end_at = steps  # the step at which the fault was over
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            watcher = gradtrack.watch(
                model, backend=backends, optimizer=optimizer, log_every=1, histograms=False,
                flush_timeout_s=300, mlflow={"tracking_uri": uri, "retry_max_s": 2},
            )  # fmt: skip
            faulting = None if inject is None else threading.Thread(target=inject, args=(server,))
            for step in range(steps):
                if step == start_at and faulting is not None:
                    if embedded:
                        watcher.flush(timeout_s=120)  # the store exists: lock it
                    faulting.start()
                step_s.append(_timed_step(model, optimizer))
                if faulting is not None and end_at == steps and not faulting.is_alive():
                    end_at = step + 1 if step >= start_at else end_at
                if pace_s:
                    time.sleep(pace_s)
            if faulting is not None:
                faulting.join()
            watcher.close()
        import mlflow

        sink = watcher.sinks[0]
        assert isinstance(sink, MlflowSink) and sink.run_id is not None
        history = mlflow.MlflowClient(uri).get_metric_history(sink.run_id, "grad/total_norm")
    finally:
        server.stop()
    stored = [m.step for m in history]
    during = step_s[start_at:end_at]
    outside = step_s[:start_at] + step_s[end_at:]
    base = statistics.median(baseline)
    return {
        "stored": len(set(stored)),
        "duplicates": len(stored) - len(set(stored)),
        "dropped": watcher.dropped_steps,
        "during_ms": statistics.median(during) * 1e3,
        "outside_ms": statistics.median(outside) * 1e3 if outside else float("nan"),
        "unwatched_ms": base * 1e3,
    }


def _timed_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    begin = time.perf_counter()
    optimizer.zero_grad()
    model(torch.randn(32, 64)).pow(2).mean().backward()
    optimizer.step()
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--pace-ms", type=float, default=25.0)
    parser.add_argument("--faults", nargs="+", default=list(FAULTS), choices=list(FAULTS))
    args = parser.parse_args()
    print(f"{args.steps} steps at {args.pace_ms} ms pace, every step logged to MLflow")
    print(
        "fault | stored / logged | duplicates | dropped | step ms during fault / outside it "
        "(ratio) | unwatched step ms"
    )
    for fault in args.faults:
        with tempfile.TemporaryDirectory() as directory:
            r = run(fault, args.steps, args.pace_ms / 1e3, Path(directory))
        print(
            f"{fault} | {r['stored']} / {args.steps} | {r['duplicates']} | {r['dropped']} | "
            f"{r['during_ms']:.3f} / {r['outside_ms']:.3f} "
            f"({r['during_ms'] / r['outside_ms']:.2f}x) | {r['unwatched_ms']:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
