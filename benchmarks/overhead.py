"""Step-time overhead of gradtrack beside what users would run instead, in one process.

    python -m benchmarks.overhead [--models cnn mlp transformer stress] [--rounds 10]
    python -m benchmarks.overhead --device cuda     # on a GPU: also blocking syncs per step

Every variant trains its own copy of the model (same initial weights, same batch); variants
run round-robin in chunks of ``--steps`` steps after a warm-up. After each chunk gradtrack's
worker is flushed, so the next variant starts clean; the CPU time that flush takes (the work
the worker had not done yet, all threads) is added to the chunk's time, so work done off the
training thread is charged to the variant that caused it, while time a sink only waits (a
database commit, the worker's batching pause) is not. The figure is the median per-step
time of the chunks as a ratio to ``base``; a second line gives the mean over all chunks,
which also carries costs that come less often than once a chunk (per-layer metrics and
histograms every 100 steps by default: the default 10 rounds of 20 steps hold two of them):

- base: forward, backward, optimizer step; "base again": the same, as a control of the
  run's noise (it reads 1.00x only on a quiet machine);
- floor: base + one foreach norm pass over all gradients + one host copy;
- guard: gradtrack with no step ever logged: its every-step guard alone (one L2 pass over
  every gradient and the finite check), to be read beside the floor;
- recipe: full backward hooks on every leaf module, ``.norm().item()`` per gradient tensor;
- wandb.watch: ``wandb.watch(model, log="gradients", log_freq=1)``, offline, plus the
  ``run.log`` per step that commits what it staged;
- gradtrack summaries / + histograms every step (memory sink; per-layer max and mean |g|
  on the ``layer_every`` steps, 100 by default), "summaries,all": every statistic of every
  layer at every step (``layer_every=1``), gradtrack defaults with the
  MLflow sink (local sqlite), also with one key per layer (``layer_metrics=["norm"]``),
  gradtrack defaults with a raise rule (memory sink), defaults without the update signals
  (``update_signals=False``; the defaults sample them) and with the exact ones (``True``),
  gradtrack with ``activations=True`` (every step).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gradtrack
from benchmarks.models import MODELS
from gradtrack.sinks import MemorySink

Hooks = tuple[Callable[[], None], Callable[[], None], Callable[[], None]]  # step, flush, close
Setup = Callable[[nn.Module, torch.optim.Optimizer], Hooks]


def _nothing() -> None:
    return None


def base(model: nn.Module, optimizer: torch.optim.Optimizer) -> Hooks:
    return _nothing, _nothing, _nothing


def floor(model: nn.Module, optimizer: torch.optim.Optimizer) -> Hooks:
    params = [p for p in model.parameters() if p.requires_grad]

    def look_once() -> None:
        grads = [p.grad for p in params if p.grad is not None]
        torch.stack(torch._foreach_norm(grads)).cpu()

    return look_once, _nothing, _nothing


def recipe(model: nn.Module, optimizer: torch.optim.Optimizer) -> Hooks:
    norms: list[float] = []

    def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        norms.extend(g.norm().item() for g in grad_output if g is not None)

    leaves = [m for m in model.modules() if next(m.children(), None) is None]
    # The recipe's hooks warn on the first layer (its input needs no grad); that is expected.
    warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
    handles = [m.register_full_backward_hook(hook) for m in leaves]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return norms.clear, _nothing, remove


def wandb_watch(model: nn.Module, optimizer: torch.optim.Optimizer) -> Hooks:
    import wandb

    run = wandb.run if wandb.run is not None else wandb.init(mode="offline", dir=tempfile.mkdtemp())
    wandb.watch(model, log="gradients", log_freq=1)
    return lambda: run.log({"step": 1}), _nothing, lambda: wandb.unwatch(model)


def gradtrack_variant(backend: Any = None, **options: Any) -> Setup:
    def setup(model: nn.Module, optimizer: torch.optim.Optimizer) -> Hooks:
        watcher = gradtrack.watch(
            model, backend=backend if backend is not None else MemorySink(), optimizer=optimizer,
            **options,
        )  # fmt: skip

        def flush() -> None:
            watcher.flush()

        return _nothing, flush, watcher.close

    return setup


VARIANTS: dict[str, Setup] = {
    "base": base,
    "base again": base,  # A/A control: how far two identical variants read apart in this run
    "floor": floor,
    # gradtrack's every-step guard alone: no step is ever logged, so what remains is the
    # one exact L2 pass (and finite check) it makes at every step.
    "guard": gradtrack_variant(log_every=10**9, histograms=False),
    # The same without the every-step spike statistics (on by default: `gradtrack.capture.spike`).
    "guard,no spike": gradtrack_variant(
        log_every=10**9, histograms=False, alerts={"spike": {"enabled": False}}
    ),
    "recipe": recipe,
    "wandb.watch": wandb_watch,
    "summaries": gradtrack_variant(log_every=1, histograms=False),
    # Every statistic of every layer at every step (max and mean |g| too: three passes).
    "summaries,all": gradtrack_variant(log_every=1, histograms=False, layer_every=1),
    "+histograms": gradtrack_variant(log_every=1, histograms={"every": 1}),
    "defaults+mlflow": gradtrack_variant(backend="mlflow"),
    # A raise rule: the rules run in the training thread and the guard's verdict is read at
    # every step (free on the CPU; one synchronisation per step on an accelerator).
    "defaults+raise": gradtrack_variant(alerts={"nonfinite": {"action": "raise"}}),
    "defaults+mlflow,norms": gradtrack_variant(backend="mlflow", layer_metrics=("norm",)),
    "defaults": gradtrack_variant(),
    "defaults,no spike": gradtrack_variant(alerts={"spike": {"enabled": False}}),
    # Skip rules: each step's layer norms and spike flags read on the host and judged before
    # optimizer.step (free on the CPU; one read per step on an accelerator).
    "defaults+skip": gradtrack_variant(
        alerts={name: {"action": "skip"} for name in ("nonfinite", "spike", "exploding")},
        skip={"journal": os.path.join(tempfile.mkdtemp(), "skipped_steps.json")},
    ),
    # The defaults measure ‖W‖ and ‖ΔW‖ (from a sample of each tensor) on logged steps: the
    # same without them, and with the exact ones (a copy of the weights before each logged
    # optimizer step).
    "defaults,no update signals": gradtrack_variant(update_signals=False),
    "defaults+update signals": gradtrack_variant(update_signals=True),
    "activations": gradtrack_variant(log_every=1, histograms=False, activations=True),
}


class Runner:
    def __init__(self, model: nn.Module, loss_of: Callable[[], torch.Tensor], setup: Setup) -> None:
        self.loss_of = loss_of
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
        self.after_backward, self.flush, self.close = setup(model, self.optimizer)
        self.times: list[float] = []
        self.syncs: list[int] = []

    def run(self, steps: int, device: torch.device, record: bool = True) -> None:
        start = time.perf_counter()
        for _ in range(steps):
            self.optimizer.zero_grad()
            self.loss_of().backward()
            self.after_backward()
            self.optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        trained, cpu = time.perf_counter(), time.process_time()
        self.flush()  # the worker's backlog: charged by the CPU it takes, not by its waits
        if record:
            self.times.append((trained - start + time.process_time() - cpu) / steps)

    def count_syncs(self, steps: int, device: torch.device) -> None:
        """Blocking host syncs per step in the training thread (CUDA sync debug mode)."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                self.run(steps, device, record=False)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        self.syncs.append(sum("synchroniz" in str(w.message) for w in caught))


def measure(
    model_name: str, variants: list[str], rounds: int, steps: int, device: torch.device
) -> dict[str, Any]:
    torch.manual_seed(0)
    template, _ = MODELS[model_name]()
    runners = {}
    for name in variants:
        torch.manual_seed(0)
        with device:  # model and batch made on the device
            model, loss_of = MODELS[model_name]()
        model.load_state_dict(copy.deepcopy(template.state_dict()))
        runners[name] = Runner(model, loss_of, VARIANTS[name])
    for runner in runners.values():
        runner.run(3, device, record=False)
    for _ in range(rounds):
        for runner in runners.values():
            runner.run(steps, device)
    result: dict[str, Any] = {}
    if device.type == "cuda":
        for name, runner in runners.items():
            runner.count_syncs(steps, device)
            result[f"syncs/{name}"] = runner.syncs[-1] / steps
    for runner in runners.values():
        runner.close()
    base_time = statistics.median(runners["base"].times)
    result["base_ms"] = base_time * 1e3
    result.update({name: statistics.median(r.times) / base_time for name, r in runners.items()})
    # The mean also carries what happens less often than once a chunk (per-layer metrics and
    # histograms every 100 steps by default), which the median of chunks leaves out.
    base_mean = statistics.mean(runners["base"].times)
    result.update({f"mean/{n}": statistics.mean(r.times) / base_mean for n, r in runners.items()})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    variants = ["base", *[v for v in args.variants if v != "base"]]
    os.environ.setdefault("WANDB_SILENT", "true")
    with tempfile.TemporaryDirectory() as directory:
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{directory}/mlflow.db")
        print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads; "
              "median step time / base")  # fmt: skip
        print(" | ".join(["model", "base ms", *variants[1:]]))
        for model_name in args.models:
            result = measure(model_name, variants, args.rounds, args.steps, device)
            cells = [f"{result[v]:.2f}x" for v in variants[1:]]
            print(" | ".join([model_name, f"{result['base_ms']:.1f}", *cells]), flush=True)
            means = [f"{v}: {result[f'mean/{v}']:.2f}x" for v in variants[1:]]
            print("  mean of all chunks / base: " + ", ".join(means), flush=True)
            if device.type == "cuda":
                syncs = [f"{v}: {result[f'syncs/{v}']:.1f}" for v in variants]
                print("  blocking syncs per step: " + ", ".join(syncs), flush=True)


if __name__ == "__main__":
    main()
