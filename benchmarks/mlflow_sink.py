"""The MLflow sink against a real `mlflow server` on loopback.

    python -m benchmarks.mlflow_sink [--models cnn mlp transformer]

1. Step time with the MLflow-server sink vs the memory sink, ``log_every=1``, round-robin in
   one process (median step time, ratio).
2. Metrics delivered per second: the sink's batched worker path vs one ``log_metric`` call
   per metric, both to the same server.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import gradtrack
from benchmarks.models import MODELS, LossFn
from gradtrack.formats.metrics import scalar_metrics
from gradtrack.formats.record import StepRecord
from gradtrack.sinks import MemorySink, MlflowSink
from tests.sinks.mlflow_server import MlflowServer


def cpu_seconds(root_pid: int) -> float:
    """User + system CPU time so far of a process and all its descendants (Linux /proc)."""
    stats = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(stat.parent.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (ppid, _) in stats.items() if ppid == parent]
        tree.update(children)
        frontier.extend(children)
    return sum(stats[pid][1] for pid in tree if pid in stats) / os.sysconf("SC_CLK_TCK")


def step_time_ratio(model_name: str, uri: str, rounds: int, steps: int) -> tuple[float, float]:
    torch.manual_seed(0)
    template, _ = MODELS[model_name]()
    runs: dict[str, tuple[LossFn, torch.optim.Optimizer, gradtrack.WatcherLike, list[float]]] = {}
    for name in ("memory", "mlflow"):
        torch.manual_seed(0)
        model, loss_of = MODELS[model_name]()
        model.load_state_dict(copy.deepcopy(template.state_dict()))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
        backend = MemorySink() if name == "memory" else "mlflow"
        watcher = gradtrack.watch(
            model, backend=backend, optimizer=optimizer, log_every=1,
            mlflow={"tracking_uri": uri, "experiment": "bench"},
        )  # fmt: skip
        runs[name] = (loss_of, optimizer, watcher, [])
    for _ in range(rounds + 1):
        for loss, opt, _, times in runs.values():
            for _ in range(steps):
                start = time.perf_counter()
                opt.zero_grad()
                loss().backward()
                opt.step()
                times.append(time.perf_counter() - start)
    medians = {}
    for name, (_, _, watcher, times) in runs.items():
        watcher.close()
        medians[name] = statistics.median(times[steps:])  # the first round warms up
    return medians["memory"] * 1e3, medians["mlflow"] / medians["memory"]


def delivery_rates(
    uri: str, steps: int = 200, keys: int = 100, per_metric: int = 2000
) -> tuple[float, float]:
    import mlflow

    layers = tuple(f"layer{i}" for i in range(keys // 4))
    stats = np.abs(np.random.default_rng(0).normal(size=(len(layers), 7)))
    records = [StepRecord(s, time.time(), layers, stats, 1.0) for s in range(steps)]
    sink = MlflowSink(
        gradtrack.GradtrackConfig(mlflow={"tracking_uri": uri, "experiment": "bench"})
    )
    sink.write(records[:1])  # creates the run
    start = time.perf_counter()
    sink.write(records[1:])
    sink.flush()
    batched = (len(records) - 1) * len(scalar_metrics(records[0])) / (time.perf_counter() - start)
    sink.close()
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("bench")
    assert experiment is not None  # the sink above created it
    run = client.create_run(experiment.experiment_id)
    start = time.perf_counter()
    for i in range(per_metric):
        client.log_metric(run.info.run_id, f"key{i % keys}", float(i), step=i // keys)
    single = per_metric / (time.perf_counter() - start)
    client.set_terminated(run.info.run_id)
    return batched, single


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["cnn", "mlp", "transformer"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        server = MlflowServer(f"sqlite:///{root / 'mlflow.db'}", root).start()
        try:
            print(
                "model | memory-sink step ms | MLflow-server sink / memory sink"
                " | server CPU per logged step ms"
            )
            assert server.process is not None
            for name in args.models:
                cpu_before = cpu_seconds(server.process.pid)
                base_ms, ratio = step_time_ratio(name, server.uri, args.rounds, args.steps)
                server_cpu = cpu_seconds(server.process.pid) - cpu_before
                per_step = server_cpu / ((args.rounds + 1) * args.steps) * 1e3
                print(f"{name} | {base_ms:.1f} | {ratio:.3f}x | {per_step:.2f}", flush=True)
            batched, single = delivery_rates(server.uri)
            print(f"metrics/s delivered: gradtrack worker {batched:,.0f}; "
                  f"per-metric log_metric {single:,.0f} ({batched / single:.0f}x)")  # fmt: skip
        finally:
            server.stop()


if __name__ == "__main__":
    main()
