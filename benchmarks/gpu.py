"""On an accelerator, measured: what each of gradtrack's kinds of step costs the device.

    python -m benchmarks.gpu [--models cnn mlp transformer stress bf16] [--rounds 8]
        [--steps 8] [--count-steps 5] [--big-width 2048] [--big-layers 8] [--big-tokens 1024]

Without a CUDA device it prints one line and exits 0. ``--device cpu`` (and `measure` with a
CPU device, as the tests run it) takes the same code path on the CPU, where the columns only
CUDA can measure read n/a.

For each model (the four of `benchmarks.models` and a bf16 transformer sized by
``--big-width`` / ``--big-layers`` / ``--big-tokens``), every variant first runs alone, on its
own copy of the model: a warm-up, then ``--count-steps`` steps under
``torch.cuda.set_sync_debug_mode("warn")`` (its warnings counted: blocking host syncs; and
`torch.cuda.Event.synchronize` calls made by the training thread, which it does not see),
then as many under ``torch.profiler`` (device→host memcpy events counted, how many went to
pinned memory: asynchronous ones, and the pinned allocations, which wait for the device
too), while the peak of ``torch.cuda.max_memory_allocated`` above what was allocated before
the copy was made is kept. Then all variants, each on a fresh copy, run round-robin in chunks
of ``--steps`` steps, ``--rounds`` times (`benchmarks.overhead.Runner`: the device
synchronised at the end of a chunk, gradtrack's worker flushed and the CPU time of that flush
charged to the chunk). One table: median step time, ÷ no monitoring, ÷ the floor, syncs and
copies per step beside what the design expects (benchmarks/README.md), GPU memory added over
no monitoring.

Variants: none; floor (one foreach norm pass + one host copy); wandb.watch (offline,
``log="gradients"``, every step); gradtrack's guard alone (no step logged); a logged step
(every step, no histograms); a histogram step (every step); a raise rule and skip rules (no
step logged: what the rule itself costs each step).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import math
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn

from benchmarks import models
from benchmarks.overhead import Runner, Setup, base, floor, gradtrack_variant, wandb_watch

Build = Callable[[], tuple[nn.Module, models.LossFn]]
NO_CUDA = "no CUDA device: nothing measured"
PINNED_ALLOCATIONS = {"cudaHostAlloc", "cudaMallocHost", "cudaHostRegister"}  # runtime calls
QUIET = {"log_every": 10**9, "histograms": False}  # step 0 (in the warm-up) is the only logged one


def _skip_rules(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    journal = os.path.join(tempfile.mkdtemp(), "skipped_steps.json")
    rules = {name: {"action": "skip"} for name in ("nonfinite", "spike", "exploding")}
    return gradtrack_variant(**QUIET, alerts=rules, skip={"journal": journal})(model, optimizer)


VARIANTS: dict[str, Setup] = {
    "none": base,
    "floor": floor,
    "wandb.watch": wandb_watch,
    "guard": gradtrack_variant(**QUIET),
    "logged step": gradtrack_variant(log_every=1, histograms=False),
    "histogram step": gradtrack_variant(log_every=1, histograms={"every": 1}),
    "raise rule": gradtrack_variant(**QUIET, alerts={"nonfinite": {"action": "raise"}}),
    "skip rule": _skip_rules,
}


class Expected(NamedTuple):
    """Per step, on an accelerator: blocking syncs (event waits included), device→host
    copies, and how many of them go to pinned memory (asynchronous)."""

    syncs: int
    copies: int
    pinned: int


# What the design says each variant costs the training thread per step on an accelerator
# (benchmarks/README.md); None: not gradtrack's to promise. No variant should allocate pinned
# memory once warm (a cudaHostAlloc waits for the device too).
EXPECTED: dict[str, Expected | None] = {
    "none": Expected(0, 0, 0),
    "floor": Expected(1, 1, 0),  # its .cpu(): one blocking copy
    "wandb.watch": None,
    "guard": Expected(0, 0, 0),  # the verdict latched on the device
    # The statistics' copy at the end of backward, and the update signals' (sampled by
    # default) after optimizer.step: both asynchronous, into pinned memory.
    "logged step": Expected(0, 2, 2),
    "histogram step": Expected(0, 2, 2),  # the samples ride in the statistics' copy
    "raise rule": Expected(1, 1, 0),  # the verdict read at every step
    "skip rule": Expected(1, 1, 0),  # the verdict, layer norms and spike flags: one read
}


@dataclass
class Row:
    """One variant on one model. None: not measurable on this device (n/a)."""

    model: str
    variant: str
    step_ms: float = math.nan
    vs_none: float = math.nan
    vs_floor: float = math.nan
    syncs: float | None = None
    event_waits: float | None = None
    copies: float | None = None
    pinned: float | None = None
    host_allocs: float | None = None
    memory_mib: float | None = None
    error: str | None = None
    times: list[float] = field(default_factory=list, repr=False)

    @property
    def check(self) -> str:
        expected = EXPECTED.get(self.variant)
        if self.error is not None:
            return "failed"
        if expected is None or self.syncs is None or self.copies is None:
            return "—"
        syncs = self.syncs + (self.event_waits or 0.0)
        measured = (syncs, self.copies, self.pinned)
        return "ok" if measured == expected and not self.host_allocs else "UNEXPECTED"


def build_model(build: Build, device: torch.device) -> tuple[nn.Module, models.LossFn]:
    torch.manual_seed(0)  # every copy starts from the same weights and batch
    with device:
        return build()


def train(runner: Runner, steps: int) -> None:
    """Steps as `Runner.run` takes them, without its synchronisation and flush."""
    for _ in range(steps):
        runner.optimizer.zero_grad()
        runner.loss_of().backward()
        runner.after_backward()
        runner.optimizer.step()


@contextlib.contextmanager
def event_waits_of_this_thread(counter: list[int]) -> Iterator[None]:
    """Counts `torch.cuda.Event.synchronize` calls made by this thread (sync debug mode
    does not see them; gradtrack's worker waits on its copies so, on its own thread)."""
    original = torch.cuda.Event.synchronize
    thread = threading.get_ident()

    def synchronize(self: torch.cuda.Event) -> None:
        if threading.get_ident() == thread:
            counter[0] += 1
        original(self)

    torch.cuda.Event.synchronize = synchronize  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.cuda.Event.synchronize = original  # type: ignore[method-assign]


def count_syncs(runner: Runner, steps: int, device: torch.device) -> tuple[float, float] | None:
    """(blocking syncs, event waits) per step in the training thread; None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    waits = [0]
    with warnings.catch_warnings(record=True) as caught, event_waits_of_this_thread(waits):
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train(runner, steps)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(device)
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return syncs / steps, waits[0] / steps


def count_copies(
    runner: Runner, steps: int, device: torch.device
) -> tuple[float, float, float] | None:
    """(device→host memcpys, those into pinned memory, cudaHostAlloc calls) per step, from
    a profiler trace; None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        train(runner, steps)
        torch.cuda.synchronize(device)
    names = [event.name for event in trace.events()]
    copies = [name for name in names if name.startswith("Memcpy DtoH")]
    pinned = sum("Pinned" in name for name in copies)
    allocs = sum(name in PINNED_ALLOCATIONS for name in names)
    return len(copies) / steps, pinned / steps, allocs / steps


def count_alone(
    row: Row, build: Build, setup: Setup, device: torch.device, count_steps: int
) -> None:
    """Syncs, copies and memory of one variant, on a copy of the model of its own."""
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    runner = Runner(*build_model(build, device), setup)
    try:
        runner.run(3, device, record=False)  # warm-up: caches, step 0 (logged by every variant)
        measured = count_syncs(runner, count_steps, device)
        runner.flush()
        if measured is not None:
            row.syncs, row.event_waits = measured
        copies = count_copies(runner, count_steps, device)
        runner.flush()
        if copies is not None:
            row.copies, row.pinned, row.host_allocs = copies
        if cuda:
            row.memory_mib = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    finally:
        runner.close()


def time_round_robin(
    rows: dict[str, Row], build: Build, device: torch.device, rounds: int, steps: int
) -> None:
    """Median step time of each variant, all run in turn in one process."""
    runners = {name: Runner(*build_model(build, device), VARIANTS[name]) for name in rows}
    try:
        for runner in runners.values():
            runner.run(2, device, record=False)
        for _ in range(rounds):
            for runner in runners.values():
                runner.run(steps, device)
    finally:
        for runner in runners.values():
            runner.close()
    for name, runner in runners.items():
        rows[name].times = runner.times
        rows[name].step_ms = statistics.median(runner.times) * 1e3


def measure(
    model: str,
    build: Build,
    device: torch.device,
    variants: list[str] | None = None,
    rounds: int = 8,
    steps: int = 8,
    count_steps: int = 5,
) -> list[Row]:
    """One model's rows, one per variant (none and floor always among them)."""
    names = ["none", "floor", *[v for v in variants or VARIANTS if v not in ("none", "floor")]]
    rows = {name: Row(model, name) for name in names}
    for name, row in rows.items():
        try:
            count_alone(row, build, VARIANTS[name], device, count_steps)
        except Exception as exc:  # one failing variant leaves the others' measurements
            row.error = f"{type(exc).__name__}: {exc}"[:120]
    timed = {name: row for name, row in rows.items() if row.error is None}
    time_round_robin(timed, build, device, rounds, steps)
    none, floor_row = rows["none"], rows["floor"]
    own_memory = none.memory_mib  # the model's own: weights, gradients, activations
    for row in timed.values():
        row.vs_none = row.step_ms / none.step_ms
        row.vs_floor = row.step_ms / floor_row.step_ms
        if row.memory_mib is not None and own_memory is not None:
            row.memory_mib -= own_memory
    return list(rows.values())


HEADER = (
    "| model | variant | step ms | ÷ none | ÷ floor | syncs/step | event waits/step "
    "| D→H copies/step (pinned) | cudaHostAlloc/step | expected: syncs, copies (pinned) "
    "| GPU MiB added | check |"
)


def _cell(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def format_row(row: Row) -> str:
    if row.error is not None:
        return f"| {row.model} | {row.variant} | failed: {row.error} |"
    expected = EXPECTED.get(row.variant)
    copies = "n/a" if row.copies is None else f"{row.copies:.2f} ({_cell(row.pinned)})"
    cells = [
        row.model, row.variant, f"{row.step_ms:.2f}", f"{row.vs_none:.2f}x",
        f"{row.vs_floor:.2f}x", _cell(row.syncs), _cell(row.event_waits), copies,
        _cell(row.host_allocs), "—" if expected is None else
        f"{expected.syncs}, {expected.copies} ({expected.pinned})",
        _cell(row.memory_mib, 1), row.check,
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


@contextlib.contextmanager
def wandb_offline() -> Iterator[None]:
    """One offline W&B run for ``wandb.watch`` to log into, finished afterwards."""
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    with tempfile.TemporaryDirectory() as directory:
        run = wandb.init(project="gradtrack-bench", mode="offline", dir=directory)
        try:
            yield
        finally:
            run.finish()


def builders(big_width: int, big_layers: int, big_tokens: int) -> dict[str, Build]:
    bf16 = partial(models.bf16_transformer, layers=big_layers, width=big_width, tokens=big_tokens)
    return {**models.MODELS, "bf16": bf16}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=[*models.MODELS, "bf16"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--count-steps", type=int, default=5)
    parser.add_argument("--big-width", type=int, default=2048)
    parser.add_argument("--big-layers", type=int, default=8)
    parser.add_argument("--big-tokens", type=int, default=1024, help="per sequence (batch 4)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    available = builders(args.big_width, args.big_layers, args.big_tokens)
    unknown = sorted(set(args.models) - set(available))
    if unknown:
        parser.error(f"unknown models {unknown}: choose from {sorted(available)}")
    started = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__} on {device} ({name}); median of {args.rounds} chunks "
          f"of {args.steps} steps; counts over {args.count_steps} steps")  # fmt: skip
    variants = args.variants
    if "wandb.watch" in variants and importlib.util.find_spec("wandb") is None:
        print("(wandb is not installed: no wandb.watch rows)")
        variants = [v for v in variants if v != "wandb.watch"]
    print(HEADER)
    print("|" + " --- |" * HEADER.count(" | ") + " --- |")
    with wandb_offline() if "wandb.watch" in variants else contextlib.nullcontext():
        for model in args.models:
            for row in measure(model, available[model], device, variants, args.rounds,
                               args.steps, args.count_steps):  # fmt: skip
                print(format_row(row), flush=True)
    print(f"({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
