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
  without max/mean |g|; and a per-layer step (with them);
- guard+spike: the guard with the every-step spike statistics (`gradtrack.capture.spike`: layer
  norms
  from the guard's, the window's z-scores), as default watching runs it at every step;
- guard+spike+flight: that and the flight recorder (`gradtrack.capture.flight_ring`): the step's
  layer
  norms copied into the ring, and every 10th step (``log_every``) the steps since the last
  hand-off taken for the logged step's copy; "flight alone" times the recorder by itself on
  the layer norms the spike rule computes anyway, also as a share of one backward (the
  median of 5), and the ring's memory ((K + 1) × (1 + layers) × 8 bytes) in KiB;
- guard+skip: that, read on the host and judged by the skip rules (`gradtrack.capture.skip`), as
  every step runs with ``action="skip"``;
- update signals: what ``update_signals=True`` adds to a logged step (`gradtrack.capture.handover`:
  copy the weights into the reused buffer and take their norms, then the update's norms).
  Its memory is one copy of the trainable parameters, printed in MiB;
- sampled updates: what the default (``update_signals="sampled"``) adds to a logged step
  (`gradtrack.capture.handover`: the weights' norms, a strided copy of each tensor's sample,
  then its difference's norms), and the memory its samples keep, in MiB.

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
from gradtrack.capture.flight_ring import FlightRecorder
from gradtrack.capture.skip import SkipPolicy
from gradtrack.capture.spike import LayerNorms, NormWindow, on_host
from gradtrack.capture.updates import SampledUpdateProbe, UpdateProbe
from gradtrack.handoff.layout import spike_fields
from gradtrack.handoff.rules import PerStepRules
from gradtrack.sinks import MemorySink


def measure(name: str, reps: int) -> dict[str, float]:
    torch.manual_seed(0)
    model, loss_fn = MODELS[name]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    watcher = gradtrack.watch(model, backend=MemorySink(), optimizer=optimizer)
    assert isinstance(watcher, gradtrack.Watcher)  # not switched off: its parts are read
    collector = watcher.collector
    backward_s = []
    for _ in range(5):  # the median of 5: the first backward of a process is slower
        start = time.perf_counter()
        loss_fn().backward()
        backward_s.append(time.perf_counter() - start)
    step_s = statistics.median(backward_s)
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

    names = collector.index.layer_names
    layer_norms = LayerNorms(collector.index.tensor_layer, len(names))
    spikes = NormWindow(len(names), 128, 32, [6.0] * (1 + len(names)), [3.0] * (1 + len(names)),
                        [True] * (1 + len(names)))  # fmt: skip
    policy = SkipPolicy(PerStepRules(watcher.config.alerts, names), max_consecutive=5)

    def guard_spike() -> None:
        checked = collector.guard(exact=False)
        checked.finite()
        spikes.update(layer_norms(checked), host=on_host(checked))

    ring = FlightRecorder(257, len(names))  # K = 256, and the incident
    counter = [0]

    def guard_spike_flight() -> None:
        checked = collector.guard(exact=False)
        checked.finite()
        norms = layer_norms(checked)
        spikes.update(norms, host=on_host(checked))
        ring.record(counter[0], norms)
        counter[0] += 1
        if counter[0] % 10 == 0:
            ring.take()

    step_norms = layer_norms(collector.guard(exact=False))

    def flight() -> None:  # the recorder alone, on the norms the spike rule has already
        ring.record(counter[0], step_norms)
        counter[0] += 1
        if counter[0] % 10 == 0:
            ring.take()

    def guard_skip() -> None:
        checked = collector.guard(exact=False)
        norms = layer_norms(checked)
        host = torch.cat([norms, spikes.update(norms, host=on_host(checked))]).numpy()
        spike_fields(host[len(norms) :])
        policy.decide(bool(checked.finite()), host[: len(norms)], host[len(norms) :])

    probe = UpdateProbe(collector.params)

    def update_signals() -> None:
        probe.before()
        probe.after()

    sampled = SampledUpdateProbe(collector.params)

    def sampled_updates() -> None:
        sampled.before()
        sampled.after()

    variants: dict[str, Callable[[], None]] = {
        "floor": floor, "guard": guard, "exact_guard": exact_guard, "logged": logged,
        "per_layer": per_layer, "guard_spike": guard_spike,
        "guard_spike_flight": guard_spike_flight, "flight": flight, "guard_skip": guard_skip,
        "update_signals": update_signals, "sampled_updates": sampled_updates,
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
    result["snapshot_mib"] = sum(p.numel() * p.element_size() for p in collector.params) / 2**20
    result["sample_mib"] = sampled.sample_bytes / 2**20
    result["flight_kib"] = ring.nbytes / 2**10
    result["flight_share"] = result["flight"] / result["backward"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median ms (÷ floor)")
    print(
        "model | one backward | floor | guard | exact guard | logged step | per-layer step | "
        "guard+spike | guard+spike+flight | flight alone | flight ÷ backward | ring (KiB) | "
        "guard+skip | "
        "update signals | their buffer (MiB) | sampled updates | their samples (MiB)"
    )
    variants = (
        "guard", "exact_guard", "logged", "per_layer", "guard_spike", "guard_spike_flight",
        "flight", "guard_skip", "update_signals", "sampled_updates",
    )  # fmt: skip
    for name in args.models:
        r = measure(name, args.reps)
        cells = [f"{r[k]:.3f} ({r[k] / r['floor']:.2f}x)" for k in variants]
        row = [
            name,
            f"{r['backward']:.1f}",
            f"{r['floor']:.3f}",
            *cells[:7],
            f"{100 * r['flight_share']:.3f} %",
            f"{r['flight_kib']:.0f}",
            *cells[7:-1],
            f"{r['snapshot_mib']:.1f}",
            cells[-1],
            f"{r['sample_mib']:.2f}",
        ]
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
