"""Step-time overhead of gradtrack, every variant side by side in one process.

    python -m benchmarks.overhead [--models cnn mlp] [--rounds 15] [--steps 20]

Variants run round-robin in chunks of ``--steps`` steps after a warm-up, each on its own copy
of the model; the figure is the median step time as a ratio to the unwatched ``base``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gradtrack
from benchmarks.models import MODELS
from gradtrack.rules import RULE_TYPES
from gradtrack.sinks import MemorySink

RULES_OFF = {"alerts": {rule: {"enabled": False} for rule in RULE_TYPES}}
VARIANTS: dict[str, dict[str, Any] | None] = {
    "base": None,
    "defaults": {},
    "log_every=1": {"log_every": 1, "hist_every": None},
    "log_every=1, rules off": {"log_every": 1, "hist_every": None, **RULES_OFF},
    "log_every=1, hist_every=1": {"log_every": 1, "hist_every": 1},
    "log_every=1, activations": {"log_every": 1, "hist_every": None, "activations": True},
}


class Runner:
    def __init__(self, model: nn.Module, loss_of: Callable[[], torch.Tensor], options: Any) -> None:
        self.model, self.loss_of = model, loss_of
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        self.watcher = None
        if options is not None:
            self.watcher = gradtrack.watch(
                model, backend=MemorySink(), optimizer=self.optimizer, **options
            )
        self.times: list[float] = []

    def run(self, steps: int, record: bool = True) -> None:
        for _ in range(steps):
            start = time.perf_counter()
            self.optimizer.zero_grad()
            self.loss_of().backward()
            self.optimizer.step()
            if record:
                self.times.append(time.perf_counter() - start)


def measure(model_name: str, rounds: int, steps: int) -> dict[str, float]:
    torch.manual_seed(0)
    template, _ = MODELS[model_name]()
    runners = {}
    for name, options in VARIANTS.items():
        torch.manual_seed(0)
        model, loss_of = MODELS[model_name]()
        model.load_state_dict(copy.deepcopy(template.state_dict()))
        runners[name] = Runner(model, loss_of, options)
    for runner in runners.values():
        runner.run(10, record=False)
    for _ in range(rounds):
        for runner in runners.values():
            runner.run(steps)
    for runner in runners.values():
        if runner.watcher is not None:
            runner.watcher.close()
    medians = {name: statistics.median(r.times) for name, r in runners.items()}
    return {"base_ms": medians["base"] * 1e3} | {
        name: medians[name] / medians["base"] for name in VARIANTS if name != "base"
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--models", nargs="+", default=["cnn", "mlp", "transformer"], choices=list(MODELS)
    )
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; ratio = median step / base"
    )
    header = ["model", "base ms", *[name for name in VARIANTS if name != "base"]]
    print(" | ".join(header))
    for model_name in args.models:
        result = measure(model_name, args.rounds, args.steps)
        cells = [f"{result[name]:.3f}x" for name in VARIANTS if name != "base"]
        print(" | ".join([model_name, f"{result['base_ms']:.2f}", *cells]), flush=True)


if __name__ == "__main__":
    main()
