"""The signals beyond the gradients' statistics that a watch may ask for (docs/signals.md):
the every-step spike statistics, the skip rules and the update signals, checked and built
at watch time."""

from __future__ import annotations

from dataclasses import dataclass

from gradtrack.capture.collect import Collector
from gradtrack.capture.flight_ring import FlightRecorder
from gradtrack.capture.skip import Journal, SkipPolicy
from gradtrack.capture.spike import LayerNorms, NormWindow
from gradtrack.capture.update_sample import SampledUpdateProbe
from gradtrack.capture.updates import UpdateProbe
from gradtrack.config import GradtrackConfig
from gradtrack.config.rules import SKIPPABLE
from gradtrack.errors import GradtrackError


@dataclass
class Signals:
    spikes: NormWindow | None = None  # every step's spike statistics
    skips: SkipPolicy | None = None  # the rules whose action is "skip"
    journal: Journal | None = None  # the skipped steps, on disk
    layer_norms: LayerNorms | None = None  # every step's layer norms (for these three)
    flight: FlightRecorder | None = None  # the last steps' layer norms, on the device
    updates: UpdateProbe | SampledUpdateProbe | None = None  # each logged step's ‖ΔW‖, ‖W‖
    # Why the default (sampled) update signals are off, said once when watching starts.
    missing: str | None = None


def build_signals(
    config: GradtrackConfig,
    collector: Collector,
    own_steps: bool,
    guard_every_step: bool,
    scaled: bool = False,
) -> Signals:
    """The signals ``config`` asks for. ``own_steps``: each step is one step of a given
    optimizer (and no scaler), which gradtrack's hooks wrap: skipping and update signals
    need it; ``guard_every_step``: the guard reads every step (spikes need it); ``scaled``:
    a GradScaler ends the steps."""
    rules = config.alerts
    layer_names = collector.index.layer_names
    skip_rules = rules.skip_rules()
    exact = config.update_signals is True
    if (skip_rules or exact) and not own_steps:
        feature = f"action='skip' ({', '.join(skip_rules)})" if skip_rules else "update_signals"
        raise GradtrackError(
            f"{feature} needs optimizer= (without scaler=): gradtrack must be at the "
            "optimizer's step, before and after it runs. (A GradScaler already skips "
            "non-finite steps by itself.)"
        )
    if skip_rules and collector.partitions is not None:
        raise GradtrackError(
            f"action='skip' ({', '.join(skip_rules)}) cannot leave out a DeepSpeed ZeRO step: "
            "the ZeRO optimizer steps its own partitions; use action='raise' or 'warn'"
        )
    if exact and collector.sharded_weights:
        raise GradtrackError(
            "update_signals does not support sharded parameters (FSDP2, ZeRO-3) yet"
        )
    signals = Signals()
    columns: list[str | None] = [None, *layer_names]
    spike_on = [rules.for_layer("spike", layer).enabled for layer in columns]
    if any(spike_on) and guard_every_step:
        signals.spikes = NormWindow(
            len(layer_names), rules.spike.window, rules.spike.warmup,
            z=[rules.for_layer("spike", layer).z for layer in columns],
            ratio=[rules.for_layer("spike", layer).ratio for layer in columns],
            enabled=spike_on,
        )  # fmt: skip
    if skip_rules:
        signals.skips = SkipPolicy(rules, layer_names, config.skip.max_consecutive)
        signals.journal = Journal(config.skip.journal)
    if config.flight.enabled and guard_every_step:
        signals.flight = FlightRecorder(config.flight.steps + 1, len(layer_names))  # + the incident
    raise_rules = rules.with_action("raise", SKIPPABLE)  # judged on every step's norms
    if signals.spikes or signals.skips or signals.flight or raise_rules:
        signals.layer_norms = LayerNorms(collector.index.tensor_layer, len(layer_names))
    if exact:
        signals.updates = UpdateProbe(collector.params)
    elif config.update_signals == "sampled":
        signals.missing = _sampled_missing(own_steps, collector.sharded_weights, scaled)
        if signals.missing is None:
            signals.updates = SampledUpdateProbe(collector.params, seed=config.histograms.seed)
    return signals


def _sampled_missing(own_steps: bool, sharded: bool, scaled: bool) -> str | None:
    """What the default update signals (and the learning_rate rule's evidence) lack here."""
    if scaled:
        return (
            "update ratios and the learning-rate diagnosis are off under a GradScaler: its "
            "steps end at scaler.update(), after the optimizer has stepped"
        )
    if not own_steps:
        return "update ratios and the learning-rate diagnosis are off: they need optimizer="
    if sharded:
        return "update ratios are off: sharded parameters (FSDP2, ZeRO-3) are not supported yet"
    return None
