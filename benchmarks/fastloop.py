"""What gradtrack costs a short training step, beside the alternatives, in one run.

    python -m benchmarks.fastloop [--models tight tiny300] [--rounds 3] [--steps 2000]
                                  [--variants none floor ...] [--threads 1] [--chunk 100]
                                  [--against REV] [--phases]

Steps of 13-125 ms (`benchmarks.overhead`) hide a fixed cost of a millisecond; a 0.6 ms step
does not. Two models, trained with SGD and ``optimizer=`` given:

- ``tight``: an MLP 32→64→64→4 (three Linear layers, ReLU), batch 16 — a tight loop with no
  sleep, where the Python thread is busy the whole step;
- ``tiny300``: 300 × (Linear(8, 8), Tanh), batch 16 — launch-bound: many small ops per step.

Each variant runs in a fresh process of its own (so that no variant's threads or hooks run
during another's steps), the variants in turn round by round. In its process the variant's
model trains beside an unwatched copy of itself, in alternating chunks of 100 steps (a chunk
holds ten logged steps at the defaults, so their cost is in it); a process's figure is the
median over chunk pairs of variant ÷ base, so that the machine's noise, which moves a whole
process by tens of percent here, falls on both. A worker process behind the loop catches up
while the base chunk runs: ``--chunk 2000`` (with ``--steps 8000``) measures long stretches of
training instead, where it cannot. The table gives the median over rounds of
those ratios, each round's, and the variant's median ms per step. Work the worker leaves
for later (a batched MLflow request) may fall in either chunk of a pair. ``close`` is the
time ``close()`` took at the end (delivery of what was still on its way), and ``stored`` the
steps MLflow's store holds after it.

Variants: ``none``; ``floor`` (one foreach L2 pass every step, a host copy every 10th: the
cheapest look at every gradient); ``hf`` (Hugging Face's way: ``clip_grad_norm_`` every step,
``.item()`` every 10th); ``wandb_watch`` (``wandb.watch(log="gradients", log_freq=10)``,
offline); ``guard`` (gradtrack, ``log_every=10**9`` and no histograms: only the every-step guard —
its norms, spike window and flight recorder — memory sink);
``defaults`` (memory sink), ``defaults_mlflow`` (MLflow's embedded sqlite store),
``defaults_wandb`` (W&B offline); ``every_step`` (``log_every=1``, memory sink) and
``every_step_mlflow`` (``log_every=1``, MLflow sqlite). Two more measure a design rather than
a setting (not in the default set): ``defaults_no_worker`` and ``every_step_no_worker`` are
``defaults`` and ``every_step`` with the worker dropping each step as it takes it (a step
that waits for a verdict is answered): what the training process pays once the worker's
Python (assembly, rules, sinks) no longer runs in it — the bound a worker in a child process
could reach, before the cost of handing it each step. ``defaults_mlflow_thread`` and
``every_step_mlflow_thread`` are the MLflow variants with ``delivery.process=False``: the
worker a thread of the training process, as before the worker process (#39).

``--phases`` says where the cost lands in the log cycle: each variant's extra µs over the
unwatched copy in each part of a step (forward, backward, optimizer step), by the step's
phase modulo 10 (step 0 of 10 is logged at the defaults), medians over rounds. A logged
step's cost is not only its own: the Python it runs evicts the loop's caches, and the next
steps pay for it.

``--against REV`` measures a change: each variant runs once per round in this checkout and once
in git revision ``REV`` (extracted with ``git archive``; its own ``benchmarks.fastloop`` and
``gradtrack`` in its child), in turn, and the table gives both medians and their difference.
"""

from __future__ import annotations

import argparse
import copy
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
DESIGN_VARIANTS = (
    "defaults_no_worker",
    "every_step_no_worker",
    "defaults_mlflow_thread",
    "every_step_mlflow_thread",
)
CHUNK = 100
WARMUP = 200  # (a multiple of LOG_EVERY: the loop's steps and gradtrack's share their phase)
LOG_EVERY = 10  # gradtrack's default: every variant's cadence but every_step's and guard's
ROOT = Path(__file__).resolve().parents[1]


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
    if variant in ("defaults", "every_step", "defaults_no_worker", "every_step_no_worker"):
        every = 1 if variant.startswith("every_step") else LOG_EVERY
        watcher = gradtrack.watch(model, MemorySink(), optimizer=optimizer, log_every=every)
        if variant.endswith("_no_worker"):

            def drop(item: Any, records: Any, events: Any) -> None:
                reply = getattr(item, "reply", None)
                if reply is not None:
                    reply.answer(None)

            watcher.worker._process = drop  # type: ignore[attr-defined]
        return watcher
    if "_mlflow" in variant:
        every = 1 if variant.startswith("every_step") else LOG_EVERY
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"
        apart = not variant.endswith("_thread")  # the worker in a child process, or a thread
        return gradtrack.watch(
            model, "mlflow", optimizer=optimizer, log_every=every, delivery={"process": apart}
        )
    if variant == "defaults_wandb":
        import wandb

        wandb.init(mode="offline", dir=str(work), project="fastloop")
        return gradtrack.watch(model, "wandb", optimizer=optimizer)
    if variant == "wandb_watch":
        import wandb

        wandb.init(mode="offline", dir=str(work), project="fastloop")
        wandb.watch(model, log="gradients", log_freq=LOG_EVERY)
        return None
    return None


def _stored_steps(variant: str, work: Path) -> int | None:
    """Steps MLflow's store holds for the run (the total norm's series), after close."""
    if "_mlflow" not in variant:
        return None
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return len(client.get_metric_history(runs[0].info.run_id, "grad/total_norm"))


class Loop:
    """One model's training loop, run a chunk at a time."""

    def __init__(self, variant: str, model: nn.Module, batch: tuple[Any, Any]) -> None:
        self.variant, self.model, self.batch = variant, model, batch
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        self.params = list(model.parameters())
        self.step = 0

    def run(self, steps: int, parts: list[tuple[float, float, float]] | None = None) -> float:
        """Train ``steps`` steps; the time per step. ``parts``: each step's forward (with
        ``zero_grad`` and the loss), backward and optimizer step (the rest) appended to it."""
        x, y = self.batch
        clock = time.perf_counter
        start = clock()
        for _ in range(steps):
            began = clock()
            self.optimizer.zero_grad()
            loss = nn.functional.mse_loss(self.model(x), y)
            forward = clock()
            loss.backward()
            backward = clock()
            if self.variant == "floor":
                norms = torch._foreach_norm([p.grad for p in self.params])  # type: ignore[misc]
                if self.step % LOG_EVERY == 0:
                    torch.stack(norms).cpu()
            elif self.variant == "hf":
                norm = nn.utils.clip_grad_norm_(self.params, 1e9)
                if self.step % LOG_EVERY == 0:
                    norm.item()
            self.optimizer.step()
            self.step += 1
            if parts is not None:
                parts.append((forward - began, backward - forward, clock() - backward))
        return (clock() - start) / steps


def phase_costs(
    base: list[tuple[float, float, float]], watched: list[tuple[float, float, float]]
) -> list[list[float]]:
    """Per phase of the log cycle (the watched loop's step modulo `LOG_EVERY`, its steps
    counted from 0 as gradtrack counts them), the median extra µs of each part of a step —
    forward, backward, optimizer step — over the unwatched loop's median."""
    typical = [statistics.median(step[part] for step in base) for part in range(3)]
    return [
        [
            (statistics.median(step[part] for step in watched[phase::LOG_EVERY]) - typical[part])
            * 1e6
            for part in range(3)
        ]
        for phase in range(LOG_EVERY)
    ]


def child(
    model_name: str,
    variant: str,
    steps: int,
    threads: int,
    chunk: int = CHUNK,
    phases: bool = False,
) -> dict[str, Any]:
    """One variant's run, in this process, beside an unwatched copy of the same model (this
    process's own base: processes differ by tens of percent on this machine): chunks of
    ``chunk`` steps alternate between the two (in turn first), and each pair's ratio is
    taken, so the machine's drift falls on both. The median ratio, the variant's median
    chunk, the time its ``close()`` took, and what its tracker stored."""
    import logging

    logging.getLogger("gradtrack").setLevel(logging.ERROR)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = make_model(model_name)
    width = 32 if model_name == "tight" else 8
    batch = (torch.randn(16, width), torch.randn(16, 4 if model_name == "tight" else 8))
    base = Loop("none", copy.deepcopy(model), batch)
    watched = Loop(variant, model, batch)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.chdir(work)
        watcher = _watch(variant, model, watched.optimizer, work)
        base.run(WARMUP)
        watched.run(WARMUP)
        ratios, times = [], []
        base_parts: list[tuple[float, float, float]] | None = [] if phases else None
        watched_parts: list[tuple[float, float, float]] | None = [] if phases else None
        for pair in range(max(1, steps // chunk)):
            if pair % 2:
                variant_s = watched.run(chunk, watched_parts)
                base_s = base.run(chunk, base_parts)
            else:
                base_s = base.run(chunk, base_parts)
                variant_s = watched.run(chunk, watched_parts)
            ratios.append(variant_s / base_s)
            times.append(variant_s)
        start = time.perf_counter()
        if watcher is not None:
            watcher.close()
        if variant in ("defaults_wandb", "wandb_watch"):
            import wandb

            wandb.finish()
        closing = time.perf_counter() - start
        stored = _stored_steps(variant, work)
    return {
        "ratio": statistics.median(ratios),
        "step_s": statistics.median(times),
        "close_s": closing,
        "stored": stored,
        "phases": phase_costs(base_parts, watched_parts) if base_parts and watched_parts else None,
    }


def run_child(
    model: str,
    variant: str,
    steps: int,
    threads: int,
    chunk: int = CHUNK,
    tree: Path | None = None,
    phases: bool = False,
) -> dict[str, Any]:
    """One variant's `child` in a process of its own: this checkout's, or ``tree``'s (a
    revision's files: its own benchmark and its own gradtrack)."""
    command = [sys.executable, "-m", "benchmarks.fastloop", "--child", model, variant]
    command += ["--steps", str(steps), "--threads", str(threads)]
    if chunk != CHUNK:  # (a revision older than ``--chunk`` runs its own, the same)
        command += ["--chunk", str(chunk)]
    if phases:
        command.append("--phases")
    env = dict(os.environ, WANDB_SILENT="true", PYTHONWARNINGS="ignore")
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, check=False, cwd=tree or ROOT
    )
    if done.returncode != 0:
        where = f" at {tree}" if tree is not None else ""
        raise SystemExit(f"{model}/{variant}{where} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def against(revision: str, args: argparse.Namespace, variants: list[str]) -> None:
    """Each variant in this checkout and in ``revision``, in turn, round by round."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp)
        archive = subprocess.run(
            ["git", "archive", revision], cwd=ROOT, capture_output=True, check=False
        )
        if archive.returncode != 0:
            raise SystemExit(f"git archive {revision} failed: {archive.stderr.decode()[-500:]}")
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        for model in args.models:
            results: dict[tuple[str, bool], list[float]] = {}
            for round_ in range(args.rounds):
                for variant in variants:
                    order = (True, False) if round_ % 2 else (False, True)
                    for here in order:
                        result = run_child(
                            model, variant, args.steps, args.threads, args.chunk,
                            None if here else tree,
                        )  # fmt: skip
                        results.setdefault((variant, here), []).append(result["ratio"])
            print(f"\n{model}: {revision} against this checkout, {args.rounds} rounds")
            print(f"| variant | {revision} | this checkout | difference | per round |")
            print("| --- | --- | --- | --- | --- |")
            for variant in variants:
                was, now = results[(variant, False)], results[(variant, True)]
                was_m, now_m = statistics.median(was), statistics.median(now)
                rounds = " ".join(f"{a:.3f}→{b:.3f}" for a, b in zip(was, now))
                difference = f"{now_m - was_m:+.3f}"
                print(f"| {variant} | {was_m:.3f}× | {now_m:.3f}× | {difference} | {rounds} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["tight", "tiny300"])
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS + DESIGN_VARIANTS
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=CHUNK, help="steps in turn, each half")
    parser.add_argument("--against", metavar="REV", help="a git revision to compare with")
    parser.add_argument(
        "--phases", action="store_true", help="where in the log cycle each variant's cost lands"
    )
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"))
    args = parser.parse_args()
    if args.child:
        model, variant = args.child
        result = child(model, variant, args.steps, args.threads, args.chunk, args.phases)
        print(json.dumps(result))
        return
    if args.against:
        against(args.against, args, list(args.variants))
        return
    variants = ["none"] + [v for v in args.variants if v != "none"]
    for model in args.models:
        results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for variant in variants:
                result = run_child(
                    model, variant, args.steps, args.threads, args.chunk, phases=args.phases
                )
                results[variant].append(result)
        base = statistics.median(r["step_s"] for r in results["none"])
        print(f"\n{model}: no monitoring {base * 1e3:.3f} ms/step, {args.rounds} rounds")
        print("| variant | ratio (median) | per round | ms/step | close s | stored |")
        print("| --- | --- | --- | --- | --- | --- |")
        for variant in variants:
            times = [r["step_s"] for r in results[variant]]
            ratios = [r["ratio"] for r in results[variant]]
            rounds = " ".join(f"{r:.2f}" for r in ratios)
            closes = max(r["close_s"] for r in results[variant])
            stored = results[variant][-1]["stored"]
            print(
                f"| {variant} | {statistics.median(ratios):.2f}× | {rounds} | "
                f"{statistics.median(times) * 1e3:.3f} | {closes:.2f} | "
                f"{'' if stored is None else stored} |"
            )
        if args.phases:
            print_phases(model, variants, results)


def print_phases(model: str, variants: list[str], results: dict[str, list[dict[str, Any]]]) -> None:
    """Each variant's extra µs per part of a step, by phase of the log cycle (medians over
    rounds): where a logged step's cost lands — in its own optimizer step (the hook that ends
    it), and in the steps around it."""
    print(f"\n{model}: extra µs over no monitoring, forward / backward / optimizer step")
    print("| variant | " + " | ".join(f"step % {LOG_EVERY} = {p}" for p in range(LOG_EVERY)) + " |")
    print("| --- " * (LOG_EVERY + 1) + "|")
    for variant in variants:
        rounds = [r["phases"] for r in results[variant] if r.get("phases")]
        if not rounds or variant == "none":
            continue
        cells = []
        for phase in range(LOG_EVERY):
            parts = [statistics.median(r[phase][part] for r in rounds) for part in range(3)]
            cells.append(" / ".join(f"{value:.0f}" for value in parts))
        print(f"| {variant} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
