"""gradtrack against ``wandb.watch(log="gradients")``, same work, one process, W&B offline.

    python -m benchmarks.wandb_watch [--models cnn mlp transformer] [--freqs 1 100]

For each model and frequency N the variants run round-robin after a warm-up: no monitoring,
``wandb.watch(model, log="gradients", log_freq=N)``, and gradtrack with summaries and
histograms every N steps (W&B sink). Every variant logs its loss each step, as a user would.
The figure is the median step time as a ratio to no monitoring.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gradtrack
from benchmarks.models import MODELS


class Variant:
    def __init__(self, model: nn.Module, loss_of: Callable[[], torch.Tensor]) -> None:
        self.model, self.loss_of = model, loss_of
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
        self.times: list[float] = []
        self.close: Callable[[], Any] = lambda: None

    def run(self, run: Any, steps: int, record: bool = True) -> None:
        for _ in range(steps):
            start = time.perf_counter()
            self.optimizer.zero_grad()
            loss = self.loss_of()
            loss.backward()
            self.optimizer.step()
            run.log({"loss": loss.item()})
            if record:
                self.times.append(time.perf_counter() - start)


def measure(model_name: str, freq: int, rounds: int, steps: int, run: Any) -> dict[str, float]:
    import wandb

    torch.manual_seed(0)
    template, _ = MODELS[model_name]()
    variants: dict[str, Variant] = {}
    for name in ("base", "wandb.watch", "gradtrack"):
        torch.manual_seed(0)
        model, loss_of = MODELS[model_name]()
        model.load_state_dict(copy.deepcopy(template.state_dict()))
        variant = variants[name] = Variant(model, loss_of)
        if name == "wandb.watch":
            wandb.watch(model, log="gradients", log_freq=freq)
            variant.close = functools.partial(wandb.unwatch, model)
        elif name == "gradtrack":
            watcher = gradtrack.watch(
                model, backend="wandb", optimizer=variant.optimizer, log_every=freq,
                histograms={"every": freq}, model_name=f"{model_name}{freq}",
                wandb={"profile_every": None},
            )  # fmt: skip
            variant.close = watcher.close
            gradtrack_watcher = watcher
    for variant in variants.values():
        variant.run(run, 5, record=False)
    for _ in range(rounds):
        for variant in variants.values():
            variant.run(run, steps)
    for variant in variants.values():
        variant.close()
    base = statistics.median(variants["base"].times)
    return {"base_ms": base * 1e3, "dropped": gradtrack_watcher.dropped_steps} | {
        name: statistics.median(v.times) / base for name, v in variants.items() if name != "base"
    }


def main() -> None:
    import wandb

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--models", nargs="+", default=["cnn", "mlp", "transformer"], choices=list(MODELS)
    )
    parser.add_argument("--freqs", nargs="+", type=int, default=[1, 100])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    os.environ.setdefault("WANDB_SILENT", "true")
    with tempfile.TemporaryDirectory() as directory:
        run = wandb.init(project="gradtrack-bench", mode="offline", dir=directory)
        threads = torch.get_num_threads()
        print(f"torch {torch.__version__}, {threads} threads, wandb {wandb.__version__}")
        print(
            "model | N | base ms | wandb.watch | gradtrack | gradtrack/wandb.watch overhead"
            " | steps gradtrack dropped"
        )
        for model_name in args.models:
            for freq in args.freqs:
                r = measure(model_name, freq, args.rounds, args.steps, run)
                watch_cost = r["wandb.watch"] - 1
                share = f"{(r['gradtrack'] - 1) / watch_cost:.2f}" if watch_cost > 0.02 else "n/a"
                print(
                    f"{model_name} | {freq} | {r['base_ms']:.1f} | {r['wandb.watch']:.2f}x | "
                    f"{r['gradtrack']:.2f}x | {share} | {r['dropped']}",
                    flush=True,
                )
        run.finish()


if __name__ == "__main__":
    main()
