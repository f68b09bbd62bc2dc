"""What the gradient noise scale costs the training thread, side by side in one run.

For each benchmark model, with one backward per step and with 4 accumulated micro-batches,
the variants take turns (round-robin, median of rounds): no watching; gradtrack's defaults
with ``noise_scale`` off; the defaults (on). Also at ``log_every=1``, where every step pays
the micro-batch norms. Reported: ms per optimizer step and the ratio on ÷ off.

    python -m benchmarks.noise_scale [--rounds 7] [--steps 20] [--models cnn,mlp,...]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch

import gradtrack
from benchmarks.models import MODELS, LossFn
from gradtrack.sinks import MemorySink

VARIANTS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "off": {"noise_scale": {"enabled": False}},
    "on": {},
    "off, log_every=1": {"noise_scale": {"enabled": False}, "log_every": 1},
    "on, log_every=1": {"log_every": 1},
}


class Run:
    def __init__(self, build: Any, template: torch.nn.Module, options: dict[str, Any] | None,
                 micro_batches: int) -> None:  # fmt: skip
        torch.manual_seed(0)
        model, self.loss_of = build()
        model.load_state_dict(copy.deepcopy(template.state_dict()))
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
        self.k = micro_batches
        self.watcher = None
        if options is not None:
            self.watcher = gradtrack.watch(
                model, backend=MemorySink(), optimizer=self.optimizer, histograms=False,
                **options,
            )  # fmt: skip
        self.times: list[float] = []

    def run(self, steps: int, record: bool = True) -> None:
        loss_of: LossFn = self.loss_of
        start = time.perf_counter()
        for _ in range(steps):
            self.optimizer.zero_grad()
            for _ in range(self.k):
                (loss_of() / self.k).backward()
            self.optimizer.step()
        trained, cpu = time.perf_counter(), time.process_time()
        if self.watcher is not None:
            self.watcher.flush()  # the worker's backlog: charged by its CPU, not its waits
        if record:
            self.times.append((trained - start + time.process_time() - cpu) / steps)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()


def measure(name: str, micro_batches: int, rounds: int, steps: int) -> dict[str, float]:
    torch.manual_seed(0)
    build = MODELS[name]
    template, _ = build()
    runs = {variant: Run(build, template, o, micro_batches) for variant, o in VARIANTS.items()}
    for run in runs.values():
        run.run(10, record=False)  # warm-up, and the accumulation seen once
    for _ in range(rounds):
        for run in runs.values():
            run.run(steps)
    for run in runs.values():
        run.close()
    return {variant: statistics.median(run.times) * 1e3 for variant, run in runs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median ms per step")
    print("| model | micro-batches | none | off | on | on ÷ off | off, every step | "
          "on, every step | on ÷ off |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models.split(","):
        for k in (1, 4):
            ms = measure(name, k, args.rounds, args.steps)
            ratio = ms["on"] / ms["off"]
            every = ms["on, log_every=1"] / ms["off, log_every=1"]
            print(f"| {name} | {k} | {ms['none']:.2f} | {ms['off']:.2f} | {ms['on']:.2f} | "
                  f"{ratio:.3f} | {ms['off, log_every=1']:.2f} | {ms['on, log_every=1']:.2f} | "
                  f"{every:.3f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
