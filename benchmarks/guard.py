"""What gradtrack's every-step guard costs, beside the floor and gradtrack's logged steps.

    python -m benchmarks.guard [--models cnn mlp transformer stress] [--reps 200]

After one backward pass of each benchmark model, in one process and interleaved so that
the machine's noise falls on every variant alike, the median time of:

- floor: one fp32 foreach L2 pass over every gradient and one host copy (what
  ``clip_grad_norm_`` does, the cheapest possible look at every gradient);
- guard: gradtrack's guard as it runs at the steps between logged ones — one fp32 L2 pass
  (overflowed norms redone in fp64) and the finite verdict;
- exact guard: the guard of a logged step — exact L2 per gradient (fp32 chunks added in
  fp64 on the CPU, over/underflow redone in fp64);
- logged step: the guard plus a logged step's collection (NaN/Inf counts, the host hand-off),
  without max/mean |g|; and a per-layer step (with them).

Ratios are to the floor. The training step itself is given for scale.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import gradtrack
from benchmarks.models import MODELS
from gradtrack.sinks import MemorySink


def measure(name: str, reps: int) -> dict[str, float]:
    torch.manual_seed(0)
    model, loss_fn = MODELS[name]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    watcher = gradtrack.watch(model, backend=MemorySink(), optimizer=optimizer)
    collector = watcher.collector
    start = time.perf_counter()
    loss_fn().backward()
    step_s = time.perf_counter() - start
    grads = [p.grad for p in model.parameters() if p.grad is not None]

    def floor() -> None:
        torch.stack(torch._foreach_norm(grads)).cpu()

    def guard() -> None:
        collector.guard(exact=False).finite()

    def exact_guard() -> None:
        collector.guard(exact=True).finite()

    def logged() -> None:
        collector.collect(collector.guard(), with_samples=False, full=False)

    def per_layer() -> None:
        collector.collect(collector.guard(), with_samples=False, full=True)

    variants: dict[str, Callable[[], None]] = {
        "floor": floor, "guard": guard, "exact_guard": exact_guard, "logged": logged,
        "per_layer": per_layer,
    }  # fmt: skip
    times: dict[str, list[float]] = {key: [] for key in variants}
    with torch.no_grad():
        for _ in range(reps):
            for key, run in variants.items():
                start = time.perf_counter()
                run()
                times[key].append(time.perf_counter() - start)
    watcher.close()
    result = {key: statistics.median(values) * 1e3 for key, values in times.items()}
    result["backward"] = step_s * 1e3
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median ms (÷ floor)")
    print("model | one backward | floor | guard | exact guard | logged step | per-layer step")
    variants = ("guard", "exact_guard", "logged", "per_layer")
    for name in args.models:
        r = measure(name, args.reps)
        cells = [f"{r[k]:.3f} ({r[k] / r['floor']:.2f}x)" for k in variants]
        print(" | ".join([name, f"{r['backward']:.1f}", f"{r['floor']:.3f}", *cells]), flush=True)


if __name__ == "__main__":
    main()
