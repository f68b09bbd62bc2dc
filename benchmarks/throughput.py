"""gradtrack's delivery against MLflow's own client, side by side, for the same metrics into
the same kind of store.

    python -m benchmarks.throughput [--steps 6000] [--layers 4]

For each store — a fresh sqlite file, and a local `mlflow server` (``--workers 1``, sqlite
behind it) — it times:

- **MLflow's own** `MlflowClient.log_batch`: the metrics in requests of 1,000 (the most one
  request takes), the best a caller of MLflow can do;
- **gradtrack's delivery**: the same steps as `StepRecord`s, appended to a run's spool (timed
  apart: that is the worker's part, off the training thread), then delivered by the courier
  through `MlflowSink.send` until the spool is empty — the path every logged step takes.

Both start after their run exists, and both run on a thread of the same lowered priority
(gradtrack's delivery threads yield the cores to training: `yield_cpu_to_training`), so a
busy machine slows them alike. Prints metrics/s for each and the ratio.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np

import gradtrack
from gradtrack.delivery.courier import SpooledCourier, yield_cpu_to_training
from gradtrack.delivery.spool import Spool
from gradtrack.formats.metrics import scalar_metrics
from gradtrack.formats.record import StepRecord
from gradtrack.sinks import MlflowSink
from tests.sinks.mlflow_server import MlflowServer

T = TypeVar("T")


def records(steps: int, layers: int) -> list[StepRecord]:
    names = tuple(f"layer{i}" for i in range(layers))
    rng = np.random.default_rng(0)
    now = time.time()
    return [
        StepRecord(step, now + step * 1e-3, names, np.abs(rng.normal(size=(layers, 7))), 1.0)
        for step in range(steps)
    ]


def on_delivery_thread(work: Callable[[], T]) -> T:
    """``work()`` on a thread of the priority gradtrack's couriers run at."""
    result: list[T] = []

    def run() -> None:
        yield_cpu_to_training()
        result.append(work())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result[0]


def mlflow_rate(uri: str, batch: list[StepRecord]) -> float:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("bench") or client.create_experiment("bench")
    experiment_id = experiment if isinstance(experiment, str) else experiment.experiment_id
    run_id = client.create_run(experiment_id, run_name="mlflow log_batch").info.run_id
    metrics = [
        Metric(key, value, int(record.wall_time * 1000), record.step)
        for record in batch
        for key, value in scalar_metrics(record).items()
    ]
    start = time.perf_counter()
    for i in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[i : i + 1000], synchronous=True)
    elapsed = time.perf_counter() - start
    client.set_terminated(run_id)
    return len(metrics) / elapsed


def gradtrack_rate(uri: str, batch: list[StepRecord], root: Path) -> tuple[float, float]:
    """(delivery metrics/s, spool appends per second)."""
    options = {"tracking_uri": uri, "experiment": "bench", "run_name": "gradtrack"}
    config = gradtrack.GradtrackConfig(mlflow={**options, "share_run": False})
    sink = MlflowSink(config)
    spool = Spool.create(root, "bench", {"0-MlflowSink": sink.spool_target()}, 1 << 40)
    errors: list[str] = []
    courier = SpooledCourier(sink, spool, "0-MlflowSink", errors.append)
    spool.append(batch[:1])
    courier.announce(spool.last_seq)
    courier.post_after("flush").wait()  # the run exists, MLflow is imported and connected
    start = time.perf_counter()
    for i in range(1, len(batch), 32):  # as the worker hands them over
        spool.append(batch[i : i + 32])
    appended = time.perf_counter() - start
    start = time.perf_counter()
    courier.announce(spool.last_seq)
    closed = courier.post_after("close", 60.0)
    closed.wait()
    elapsed = time.perf_counter() - start
    assert not errors and spool.undelivered() == 0, errors
    spool.remove()
    metrics = (len(batch) - 1) * len(scalar_metrics(batch[0]))
    return metrics / elapsed, (len(batch) - 1) / appended


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--layers", type=int, default=4, help="4 layers: 17 metrics a step")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    batch = records(args.steps, args.layers)
    keys = len(scalar_metrics(batch[0]))
    print(f"{args.steps} steps x {keys} metrics; metrics/s, {args.rounds} rounds alternating")
    print("store | MLflow log_batch | gradtrack delivery | ratio | spool appends/s")
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        server = MlflowServer(f"sqlite:///{root / 'server.db'}", root).start()
        stores = {"sqlite file": None, "mlflow server": server.uri}
        try:
            for store, uri in stores.items():
                for round_ in range(args.rounds):
                    # A fresh sqlite file per variant and round (the server's store is shared).
                    ours = uri or f"sqlite:///{root / f'ours-{round_}.db'}"
                    theirs = uri or f"sqlite:///{root / f'theirs-{round_}.db'}"
                    if uri is None:  # create both stores before timing either
                        mlflow_rate(ours, batch[:1])
                        mlflow_rate(theirs, batch[:1])
                    base = on_delivery_thread(lambda uri=theirs: mlflow_rate(uri, batch))  # type: ignore[misc]
                    rate, appends = gradtrack_rate(ours, batch, root / "spools")
                    print(f"{store} | {base:,.0f} | {rate:,.0f} | {rate / base:.2f}x | "
                          f"{appends:,.0f}", flush=True)  # fmt: skip
        finally:
            server.stop()


if __name__ == "__main__":
    main()
