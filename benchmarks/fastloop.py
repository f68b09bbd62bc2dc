"""What gradtrack costs a short training step, beside the alternatives, in one run.

    python -m benchmarks.fastloop [--models tight tiny300] [--rounds 3] [--steps 2000]
                                  [--variants none floor ...] [--threads 1]

Steps of 13-125 ms (`benchmarks.overhead`) hide a fixed cost of a millisecond; a 0.6 ms step
does not. Two models, trained with SGD and ``optimizer=`` given:

- ``tight``: an MLP 32→64→64→4 (three Linear layers, ReLU), batch 16 — a tight loop with no
  sleep, where the Python thread is busy the whole step;
- ``tiny300``: 300 × (Linear(8, 8), Tanh), batch 16 — launch-bound: many small ops per step.

Each variant runs in a fresh process of its own (so that no variant's threads or hooks run
during another's steps), the variants interleaved round by round so the machine's noise falls
on all alike. A process trains a warm-up, then ``--steps`` steps timed in chunks of 100; its
figure is the median chunk's time per step (a chunk holds ten logged steps at the defaults,
so their cost is in it). The table gives, per variant, the median over rounds of that time as
a ratio to no monitoring, and the base in ms. ``close`` is the time ``close()`` took at the
end (delivery of what was still on its way), and ``stored`` the steps the tracker holds after
it (read back from MLflow's store), where a tracker is written.

Variants: ``none``; ``floor`` (one foreach L2 pass every step, a host copy every 10th: the
cheapest look at every gradient); ``hf`` (Hugging Face's way: ``clip_grad_norm_`` every step,
``.item()`` every 10th); ``wandb_watch`` (``wandb.watch(log="gradients", log_freq=10)``,
offline); ``guard`` (gradtrack, ``log_every=10**9`` and no histograms: only the every-step guard —
its norms, spike window and flight recorder — memory sink);
``defaults`` (memory sink), ``defaults_mlflow`` (MLflow's embedded sqlite store),
``defaults_wandb`` (W&B offline); ``every_step`` (``log_every=1``, memory sink) and
``every_step_mlflow`` (``log_every=1``, MLflow sqlite).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

VARIANTS = (
    "none",  # (the second half unwatched too: an A/A control)
    "floor",
    "hf",
    "wandb_watch",
    "guard",
    "defaults",
    "defaults_mlflow",
    "defaults_wandb",
    "every_step",
    "every_step_mlflow",
)
CHUNK = 100
WARMUP = 200


def make_model(name: str) -> nn.Module:
    if name == "tight":
        return nn.Sequential(
            nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
        )
    if name == "tiny300":
        layers: list[nn.Module] = []
        for _ in range(300):
            layers += [nn.Linear(8, 8), nn.Tanh()]
        return nn.Sequential(*layers)
    raise SystemExit(f"unknown model {name!r}: tight, tiny300")


def _watch(variant: str, model: nn.Module, optimizer: Any, work: Path) -> Any:
    """Start the variant's monitoring; return what ends it (or None)."""
    import gradtrack
    from gradtrack.sinks import MemorySink

    if variant == "guard":
        return gradtrack.watch(
            model, MemorySink(), optimizer=optimizer, log_every=10**9, histograms={"every": None}
        )
    if variant in ("defaults", "every_step"):
        every = 1 if variant == "every_step" else 10
        return gradtrack.watch(model, MemorySink(), optimizer=optimizer, log_every=every)
    if variant in ("defaults_mlflow", "every_step_mlflow"):
        every = 1 if variant == "every_step_mlflow" else 10
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"
        return gradtrack.watch(model, "mlflow", optimizer=optimizer, log_every=every)
    if variant == "defaults_wandb":
        import wandb

        wandb.init(mode="offline", dir=str(work), project="fastloop")
        return gradtrack.watch(model, "wandb", optimizer=optimizer)
    if variant == "wandb_watch":
        import wandb

        wandb.init(mode="offline", dir=str(work), project="fastloop")
        wandb.watch(model, log="gradients", log_freq=10)
        return None
    return None


def _stored_steps(variant: str, work: Path) -> int | None:
    """Steps MLflow's store holds for the run (the total norm's series), after close."""
    if not variant.endswith("_mlflow"):
        return None
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return len(client.get_metric_history(runs[0].info.run_id, "grad/total_norm"))


def _train(
    variant: str, model: nn.Module, optimizer: Any, batch: tuple[Any, Any], steps: int
) -> list[float]:
    """Train ``WARMUP + steps`` steps; the time per step of each timed chunk."""
    params = list(model.parameters())
    x, y = batch
    chunks: list[float] = []
    start = time.perf_counter()
    for i in range(WARMUP + steps):
        if i >= WARMUP and (i - WARMUP) % CHUNK == 0:
            start = time.perf_counter()
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if variant == "floor":
            norms = torch._foreach_norm([p.grad for p in params])  # type: ignore[misc]
            if i % 10 == 0:
                torch.stack(norms).cpu()
        elif variant == "hf":
            norm = nn.utils.clip_grad_norm_(params, 1e9)
            if i % 10 == 0:
                norm.item()
        optimizer.step()
        if i >= WARMUP and (i - WARMUP) % CHUNK == CHUNK - 1:
            chunks.append((time.perf_counter() - start) / CHUNK)
    return chunks


def child(model_name: str, variant: str, steps: int, threads: int) -> dict[str, Any]:
    """One variant's run, in this process: the same model unwatched for half the steps
    (this process's own base: processes differ by up to ±30 % on this machine), the variant,
    its ``close()``, and unwatched again for the other half (the machine's drift cancels);
    the median chunk of base and variant, the time ``close()`` took, and what the tracker
    stored."""
    import logging

    logging.getLogger("gradtrack").setLevel(logging.ERROR)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = make_model(model_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    width = 32 if model_name == "tight" else 8
    batch = (torch.randn(16, width), torch.randn(16, 4 if model_name == "tight" else 8))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.chdir(work)
        base = _train("none", model, optimizer, batch, steps // 2)
        watcher = _watch(variant, model, optimizer, work)
        chunks = _train(variant, model, optimizer, batch, steps)
        start = time.perf_counter()
        if watcher is not None:
            watcher.close()
        if variant in ("defaults_wandb", "wandb_watch"):
            import wandb

            if variant == "wandb_watch":
                wandb.unwatch(model)
            wandb.finish()
        closing = time.perf_counter() - start
        base += _train("none", model, optimizer, batch, steps // 2)  # (drift cancels)
        stored = _stored_steps(variant, work)
    return {
        "step_s": statistics.median(chunks),
        "base_s": statistics.median(base),
        "close_s": closing,
        "stored": stored,
    }


def run_child(model: str, variant: str, steps: int, threads: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.fastloop", "--child", model, variant]
    command += ["--steps", str(steps), "--threads", str(threads)]
    env = dict(os.environ, WANDB_SILENT="true", PYTHONWARNINGS="ignore")
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{model}/{variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["tight", "tiny300"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"))
    args = parser.parse_args()
    if args.child:
        model, variant = args.child
        print(json.dumps(child(model, variant, args.steps, args.threads)))
        return
    variants = ["none"] + [v for v in args.variants if v != "none"]
    for model in args.models:
        results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for variant in variants:
                results[variant].append(run_child(model, variant, args.steps, args.threads))
        base = statistics.median(r["base_s"] for r in results["none"])
        print(f"\n{model}: no monitoring {base * 1e3:.3f} ms/step, {args.rounds} rounds")
        print("| variant | ratio (median) | per round | ms/step | close s | stored |")
        print("| --- | --- | --- | --- | --- | --- |")
        for variant in variants:
            times = [r["step_s"] for r in results[variant]]
            ratios = [r["step_s"] / r["base_s"] for r in results[variant]]  # its own base
            rounds = " ".join(f"{r:.2f}" for r in ratios)
            closes = max(r["close_s"] for r in results[variant])
            stored = results[variant][-1]["stored"]
            print(
                f"| {variant} | {statistics.median(ratios):.2f}× | {rounds} | "
                f"{statistics.median(times) * 1e3:.3f} | {closes:.2f} | "
                f"{'' if stored is None else stored} |"
            )


if __name__ == "__main__":
    main()
