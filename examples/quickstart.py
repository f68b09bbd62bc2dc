"""Quickstart: train a small CNN on synthetic data while gradtrack watches its gradient flow.

Run it with `bash scripts/demo.sh` (or `python examples/quickstart.py --help`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

import gradtrack
from gradtrack.sinks import MemorySink, MlflowSink


def make_cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    )  # fmt: skip


def synthetic_batches(steps: int, batch_size: int, seed: int = 0):
    """Noisy 3×32×32 images around one fixed random pattern per class: learnable, no download."""
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 3, 32, 32, generator=generator)
    for _ in range(steps):
        labels = torch.randint(10, (batch_size,), generator=generator)
        noise = torch.randn(batch_size, 3, 32, 32, generator=generator)
        yield patterns[labels] + 2.0 * noise, labels


def _gradtrack_command() -> str:
    """The `gradtrack` command beside this interpreter (a venv's bin/), else from the PATH."""
    beside = Path(sys.executable).parent / "gradtrack"
    return str(beside) if beside.exists() else "gradtrack"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument(
        "--layer-every", type=int, default=10,
        help="per-layer metrics every N steps (gradtrack's default, 100, suits long runs; "
        "this short demo writes them as often as the totals)",
    )  # fmt: skip
    parser.add_argument(
        "--backend", nargs="+", default=["console", "mlflow"],
        help="registered sink names (default: the console and MLflow's embedded sqlite store)",
    )  # fmt: skip
    args = parser.parse_args()

    torch.manual_seed(0)
    model = make_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    memory = MemorySink()
    watcher = gradtrack.watch(
        model,
        backend=[*args.backend, memory],
        optimizer=optimizer,
        log_every=args.log_every,
        layer_every=args.layer_every,
        console={"interval_s": 1.0},
        mlflow={"experiment": "gradtrack-quickstart"},
    )
    start = time.perf_counter()
    with watcher:
        for step, (images, labels) in enumerate(synthetic_batches(args.steps, args.batch_size)):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            if step % 100 == 0:
                print(f"step {step:4d}  loss {loss.item():.3f}")
    elapsed = time.perf_counter() - start

    norms = memory.scalars()
    print(f"\n{args.steps} steps in {elapsed:.1f}s; gradient flow (L2 norm per layer, by depth):")
    print(f"  {'layer':<6} {'first':>10} {'mean':>10} {'last':>10}")
    for layer in watcher.layer_names:
        values = [value for _, value in norms[f"grad_norm/{layer}"]]
        mean = sum(values) / len(values)
        print(f"  {layer:<6} {values[0]:>10.3e} {mean:>10.3e} {values[-1]:>10.3e}")
    for sink in watcher.sinks:
        if isinstance(sink, MlflowSink) and sink.run_id is not None:
            print(f"\nMLflow run {sink.run_id} in {sink.tracking_uri}; browse it with:")
            print(f"  mlflow ui --backend-store-uri {sink.tracking_uri}")
            print("and render its gradient-flow report (HTML and PNGs in ./gradtrack-report) with:")
            print(
                f"  {_gradtrack_command()} report {sink.run_id} --tracking-uri {sink.tracking_uri}"
            )


if __name__ == "__main__":
    main()
