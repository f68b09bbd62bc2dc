"""A long run at full speed: memory, spool and delivery over 100,000 steps.

    python -m benchmarks.soak [--steps 100000] [--stores sqlite server] [--cadences 1 10]

Each combination of store (a fresh sqlite file; a local `mlflow server`, ``--workers 1``,
sqlite behind it) and cadence (``log_every=1``; the defaults, ``log_every=10``), with the
default histograms, runs in a process of its own: a small MLP in a tight loop (no sleep),
sampling its resident memory and the size of its spool every 1,000 steps. Reports per run:
training time, RSS after warm-up (the first 10 % of steps) and how far it moved, the spool's
largest size, `close()`'s time, and the steps MLflow holds afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.sinks.mlflow_server import MlflowServer

REPO = Path(__file__).resolve().parents[1]


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _size_mib(root: Path) -> float:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) / 2**20


def child(uri: str, steps: int, log_every: int, out: Path) -> None:
    import torch
    from torch import nn

    import gradtrack

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    spools = Path(os.environ["GRADTRACK_SPOOL_DIR"])
    watcher = gradtrack.watch(
        model, backend="mlflow", optimizer=optimizer, log_every=log_every,
        mlflow={"tracking_uri": uri, "run_name": f"soak-{log_every}"},
    )  # fmt: skip
    samples = []
    start = time.monotonic()
    for step in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if step % 1000 == 0:
            samples.append((step, time.monotonic() - start, _rss_mib(), _size_mib(spools)))
    trained = time.monotonic() - start
    watcher.close()
    closed = time.monotonic() - start - trained
    run_id = getattr(watcher.sinks[0], "run_id", None)
    out.write_text(json.dumps({"samples": samples, "trained": trained, "closed": closed,
                               "run_id": run_id, "spool_after": _size_mib(spools)}))  # fmt: skip


def run(uri: str, steps: int, log_every: int, root: Path) -> dict[str, object]:
    out = root / f"soak-{log_every}-{time.monotonic_ns()}.json"
    spools = root / f"spools-{out.stem}"
    env = {**os.environ, "GRADTRACK_SPOOL_DIR": str(spools), "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "benchmarks.soak", "--child", uri, str(steps),
               str(log_every), str(out)]  # fmt: skip
    subprocess.run(command, env=env, cwd=root, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    from mlflow import MlflowClient

    history = MlflowClient(uri).get_metric_history(result["run_id"], "grad/total_norm")
    result["stored"] = len({m.step for m in history})
    result["expected"] = len(range(0, steps, log_every))
    return result


def row(store: str, log_every: int, result: dict) -> str:
    samples = result["samples"]
    warm_from = samples[-1][0] // 10  # the first 10 % of steps warm up
    warm = [s for s in samples if s[0] >= warm_from]
    rss = [s[2] for s in warm]
    spool_max = max(s[3] for s in samples)
    return (
        f"{store} | {log_every} | {result['trained']:.0f} s | {rss[0]:.0f} → {rss[-1]:.0f} MiB "
        f"(range {max(rss) - min(rss):.0f}) | {spool_max:.1f} MiB | {result['closed']:.1f} s | "
        f"{result['stored']:,} / {result['expected']:,}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--stores", nargs="+", default=["sqlite", "server"])
    parser.add_argument("--cadences", nargs="+", type=int, default=[1, 10])
    parser.add_argument("--child", nargs=4, metavar=("URI", "STEPS", "LOG_EVERY", "OUT"))
    args = parser.parse_args()
    if args.child:
        uri, steps, log_every, out = args.child
        child(uri, int(steps), int(log_every), Path(out))
        return
    print("store | log_every | training | RSS after warm-up → end | spool, largest | close "
          "| steps stored")  # fmt: skip
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        server = None
        try:
            for store in args.stores:
                for log_every in args.cadences:
                    if store == "server":
                        if server is None:
                            server = MlflowServer(f"sqlite:///{root / 'server.db'}", root).start()
                        uri = server.uri
                    else:
                        uri = f"sqlite:///{root / f'soak-{log_every}.db'}"
                    result = run(uri, args.steps, log_every, root)
                    print(row(store, log_every, result), flush=True)
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    main()
