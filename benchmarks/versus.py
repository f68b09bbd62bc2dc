"""Two versions of gradtrack side by side in one process, on short steps.

    python -m benchmarks.versus REV [--models tight tiny300] [--rounds 40] [--options '{}']

The machine moves by tens of percent between processes, which hides a change of a few tens
of µs a step; here one process trains three copies of a model in turn, in alternating
chunks of 100 steps: one watched by the working tree's gradtrack, one by gradtrack at git
revision ``REV`` (exported and imported as a second package, ``gradtrack_rev``), one
unwatched. It prints, per model, the median extra time per step of each version over the
unwatched copy. ``--options``: keyword arguments for ``gradtrack.watch`` as JSON (default:
the guard alone, ``{"log_every": 1000000000, "histograms": false}``); the memory sink.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import gradtrack
from benchmarks.fastloop import make_model

ROOT = Path(__file__).resolve().parents[1]
GUARD = {"log_every": 10**9, "histograms": False}


def export(rev: str, into: Path) -> None:
    """gradtrack at ``rev`` as the package ``gradtrack_rev`` under ``into``."""
    archive = subprocess.run(
        ["git", "archive", rev, "gradtrack"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    package = into / "gradtrack_rev"
    (into / "gradtrack").rename(package)
    name = re.compile(r"\bgradtrack(?=[. ])")
    for path in package.rglob("*.py"):
        text = path.read_text()
        # imports only: `from gradtrack.x import`, `import gradtrack.x`, `from gradtrack import`
        text = re.sub(
            r"^(\s*(?:from|import) )gradtrack\b",
            lambda m: m.group(1) + "gradtrack_rev",
            text,
            flags=re.M,
        )
        text = name.sub("gradtrack_rev", text) if path.name == "_moved.py" else text
        path.write_text(text)


def run(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        optimizer.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        optimizer.step()
    return time.perf_counter() - start


def compare(name: str, rounds: int, options: dict[str, Any], packages: list[Any]) -> str:
    torch.manual_seed(0)
    first = make_model(name)
    models = [first] + [copy.deepcopy(first) for _ in packages]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]
    x = torch.randn(16, 32 if name == "tight" else 8)
    watchers = [
        package.watch(model, backend="memory", optimizer=optimizer, **options)
        for package, model, optimizer in zip(packages, models[1:], optimizers[1:])
    ]
    try:
        for model, optimizer in zip(models, optimizers):
            run(model, optimizer, x, 200)
        extra: list[list[float]] = [[] for _ in packages]
        base = 0.0
        for i in range(rounds):
            order = list(range(len(models)))
            if i % 2:
                order.reverse()
            times = {j: run(models[j], optimizers[j], x, 100) / 100 for j in order}
            base = times[0]
            for j in range(len(packages)):
                extra[j].append(times[j + 1] - base)
    finally:
        for watcher in watchers:
            watcher.close()
    medians = [statistics.median(e) * 1e6 for e in extra]
    return (
        f"{name}: base {base * 1e6:.0f} µs/step; "
        f"working tree +{medians[0]:.1f} µs, rev +{medians[1]:.1f} µs"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev")
    parser.add_argument("--models", nargs="+", default=["tight"], choices=["tight", "tiny300"])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--options", type=json.loads, default=GUARD)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        export(args.rev, Path(tmp))
        sys.path.insert(0, tmp)
        import gradtrack_rev  # type: ignore[import-not-found,unused-ignore]

        for name in args.models:
            print(compare(name, args.rounds, args.options, [gradtrack, gradtrack_rev]), flush=True)


if __name__ == "__main__":
    main()
