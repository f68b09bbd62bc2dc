"""Turns a collected step into its `StepRecord` and runs the alert rules on it.

`Assembler` judges and annotates a step's records (the alert rules, the flight recorder's
window, what each record writes per layer: `LayerWrites`); `RecordBuilder` builds a record
from the step's host copies, each optional part apart. Pure apart from the rules' own state:
the worker calls it, or, when a rule may raise, the training thread, before the optimizer
applies the step. One of the two, never both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np

from gradtrack.alerts import AlertEngine
from gradtrack.config import GradtrackConfig
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.histogram import Histogram, bin_samples
from gradtrack.formats.record import STAT_COLUMNS, StepRecord, summarise_layers
from gradtrack.handoff.layout import (
    L1,
    L2,
    LINF,
    TENSOR_COLUMNS,
    FirstInWindow,
    FlatUpdate,
    HostEvidence,
    HostPart,
    MeshPlaces,
    TensorIndex,
    latched_step,
    spike_fields,
)
from gradtrack.handoff.mailbox import DropCount, PendingStep, UpdateFollowUp, UpdateRows
from gradtrack.log import report
from gradtrack.worker.flight_log import FlightLog
from gradtrack.worker.noise_scale import StepNoise

T = TypeVar("T")
NORM = STAT_COLUMNS.index("norm")
_NONE: dict[str, Any] = {}  # a part that failed adds no field


@dataclass
class AssembledStep:
    """A step's records and alerts: one record, led by the latched bad step before it when
    an accelerator's guard latched one (see `gradtrack.capture.verdict`)."""

    records: list[StepRecord]
    events: list[AlertEvent]


class LayerWrites:
    """What a record writes per layer: the worker's one decision, beside the training
    thread's one decision of what the step computes.

    The training thread decides what a step computes (`gradtrack.capture.verdict`'s
    `StepJudge.plan`, ``per_layer``: a step the ``layer_every`` schedule names, or the first
    non-finite or spiking step of its window, gets max and mean |g| computed, and its record
    ``layer_detail="all"``; any other ``"none"``). Only the worker knows which records raise
    an alert (rules only a record can judge: vanishing, dead, update ratio …) and which a
    latch found, so it decides what the others write: the first record in each
    ``layer_every`` window that raised an alert, holds NaN or Inf, or was latched (its
    elements not counted) writes its per-layer norms (``layer_detail="norms"``): the step to
    look at. Only the first: a model tripping a rule at every step would otherwise write
    every layer every step. A record already written per layer keeps what it computed, and
    still takes its window's turn."""

    def __init__(self, every: int) -> None:
        self._first_in_window = FirstInWindow(every)

    def __call__(self, record: StepRecord, alerted: bool) -> StepRecord:
        if not (alerted or record.nan_count or record.inf_count or not record.counted):
            return record
        if not self._first_in_window(record.step) or record.per_layer:
            return record
        return replace(record, layer_detail="norms")


@dataclass(frozen=True)
class AssemblerPlan:
    """What a watch's `Assembler` and `AlertEngine` are made of, before either holds any
    state: plain data that pickles, so that a worker process builds the very assembler (and
    rules) a worker thread would, while the training process builds the same engine for its
    per-step rules and alert actions."""

    index: TensorIndex
    config: GradtrackConfig
    rank: int
    kinds: tuple[str, ...]
    saturating: tuple[bool, ...]
    activation_names: tuple[str, ...] = ()
    world_size: int = 0
    mesh: MeshPlaces | None = None

    def engine(self) -> AlertEngine:
        return AlertEngine(
            self.config.alerts,
            self.index.layer_names,
            self.rank,
            kinds=self.kinds,
            saturating=self.saturating,
        )

    def assembler(self, engine: AlertEngine, drops: DropCount | None = None) -> Assembler:
        return Assembler(
            self.index,
            self.config,
            engine,
            self.activation_names,
            world_size=self.world_size,
            drops=drops,
            mesh=self.mesh,
        )


class Assembler:
    """Builds a step's records (`RecordBuilder`) and evaluates the rules on them; every
    failing part is reported once and leaves the rest of the record, and the rules, to
    run."""

    def __init__(
        self,
        index: TensorIndex,
        config: GradtrackConfig,
        alert_engine: AlertEngine,
        activation_names: Sequence[str] = (),
        world_size: int = 0,
        drops: DropCount | None = None,
        mesh: MeshPlaces | None = None,
    ) -> None:
        self.alert_engine = alert_engine
        self.records = RecordBuilder(index, config, activation_names, world_size, drops, mesh)
        self._layer_names = index.layer_names
        self._layer_writes = LayerWrites(config.layer_every)
        self.flight: FlightLog | None = None
        if config.flight.enabled:
            action = lambda rule, layer: alert_engine.rule(rule, layer).action  # noqa: E731
            # An incident latched on an accelerator is read at the next logged step, up to
            # log_every steps on; the ring on the device keeps only flight.steps of them, so
            # no hand-off brings more than that: the host never needs more slack.
            slack = min(config.log_every, config.flight.steps)
            self.flight = FlightLog(index.layer_names, config.flight.steps, slack, action)

    def assemble(self, pending: PendingStep) -> AssembledStep:
        if not pending.parts:
            return self._closing(pending)
        if pending.backward_order is not None:
            names = self._layer_names
            self.alert_engine.set_backward_order([names[i] for i in pending.backward_order])
        for part in pending.parts:
            part.wait()
        evidence = pending.parts[0].evidence()
        latched = self.records.latched(pending, evidence.latch, pending.step)
        kept, events = self._judged([latched, self.records.build(pending, evidence)])
        window = lambda: self._flight(evidence.flight, kept, events)  # noqa: E731
        return AssembledStep(*self.records.part("flight window", window, (kept, events)))

    def _judged(
        self, records: list[StepRecord | None]
    ) -> tuple[list[StepRecord], list[AlertEvent]]:
        """The records the rules judged (each as `LayerWrites` says it writes), and their
        events."""
        kept: list[StepRecord] = []
        events: list[AlertEvent] = []
        for record in records:
            if record is not None:
                found = self._evaluate(record)
                kept.append(self._layer_writes(record, alerted=bool(found)))
                events += found
        return kept, events

    def _closing(self, pending: PendingStep) -> AssembledStep:
        """The step handed on at close: the bad step latched after the last logged one, and
        the window before the last step where training ended in an exception or Ctrl-C."""
        latched = self.records.latched(pending, pending.latch)
        records, events = self._judged([latched])
        window = lambda: self._flight(pending.flight_rows, records, events)  # noqa: E731
        records, events = self.records.part("flight window", window, (records, events))
        records += self.records.part("flight window", lambda: self._ending(pending), [])
        return AssembledStep(records, events)

    def _flight(
        self, rows: np.ndarray | None, records: list[StepRecord], events: list[AlertEvent]
    ) -> tuple[list[StepRecord], list[AlertEvent]]:
        """The recorder's rows kept; at an incident, its window on its record."""
        if self.flight is None:
            return records, events
        self.flight.add(rows)
        return self.flight.annotate(records, events)

    def _ending(self, pending: PendingStep) -> list[StepRecord]:
        """Training ended in an exception (or Ctrl-C): the window before its last step."""
        if self.flight is None or pending.ending is None:
            return []
        record = self.flight.ending(pending.ending, pending.step, pending.wall_time)
        return [] if record is None else [replace(record, model_name=self.records.model_name)]

    def _evaluate(self, record: StepRecord) -> list[AlertEvent]:
        no_events: list[AlertEvent] = []
        evaluate = lambda: self.alert_engine.evaluate(record)  # noqa: E731
        return self.records.part("alert rules", evaluate, no_events)

    def add_update(self, judged: AssembledStep, follow_up: UpdateFollowUp) -> None:
        """A step judged before its optimizer step: its record gets the update it applied."""
        record = judged.records[-1]
        if record.step == follow_up.step:
            fields = self.records.update_fields(follow_up.update, record.layers)
            judged.records[-1] = replace(record, **fields)


class RecordBuilder:
    """A step's `StepRecord` from its host copies: the layers' statistics, then each optional
    part — histograms, update signals, step evidence, activation gradients, rank norms, the
    noise scale — built apart (`part`): a failing part is reported once and costs only its
    fields."""

    def __init__(
        self,
        index: TensorIndex,
        config: GradtrackConfig,
        activation_names: Sequence[str],
        world_size: int,
        drops: DropCount | None,
        mesh: MeshPlaces | None,
    ) -> None:
        self.drops = drops
        self.part_errors: dict[str, int] = {}
        self.model_name = config.model_name
        self._index = index
        self._hist_bins = config.histograms.bins
        self._hist_scale = config.histograms.scale
        self._activation_names = tuple(activation_names)
        self._layer_metrics = tuple(config.layer_metrics)
        self._world_size = world_size  # replicated ranks (0: none)
        self._gather_ranks = config.distributed.gather_ranks
        self._mesh = mesh
        self._layer_position = {name: i for i, name in enumerate(index.layer_names)}
        self.noise = StepNoise(config.noise_scale, index, self._world_size)

    def latched(
        self, pending: PendingStep, latch: np.ndarray | None, logged: int | None = None
    ) -> StepRecord | None:
        """The first non-finite step an accelerator's guard latched since the last logged
        step, as a record of its layer norms (its elements were not counted)."""
        index = self._index
        latched = None if latch is None else latched_step(latch, index.n_tensors)
        if latched is None or latched[0] == logged:
            return None  # (a logged step that was bad itself is summarised in full)
        step, norms, spike = latched
        present = (norms != -1.0).nonzero()[0]
        rows = np.zeros((len(present), TENSOR_COLUMNS))
        rows[:, L2] = norms[present]
        rows[:, L1] = rows[:, LINF] = np.nan
        layers, stats, total_norm = summarise_layers(
            index.layer_names, index.tensor_layer[present], index.tensor_numel[present], rows
        )
        return StepRecord(
            step=step,
            wall_time=pending.wall_time,
            layers=layers,
            stats=stats,
            total_norm=total_norm,
            model_name=self.model_name,
            layer_metrics=self._layer_metrics,
            layer_detail="norms",
            counted=False,
            **(spike_fields(spike) if len(spike) else {}),
        )

    def build(self, pending: PendingStep, evidence: HostEvidence | None = None) -> StepRecord:
        """The step's record from its host copies and ``evidence`` (read from its first part
        if not given)."""
        if evidence is None:
            evidence = pending.parts[0].evidence()
        index = np.concatenate([part.tensor_index for part in pending.parts])
        layers, stats, total_norm = summarise_layers(
            self._index.layer_names,
            self._index.tensor_layer[index],
            self._index.tensor_numel[index],
            np.concatenate([part.stats() for part in pending.parts]),
        )
        spike = evidence.spike
        activations = evidence.activation_norms

        def noise() -> dict[str, Any]:
            return self.noise.fields(layers, stats[:, NORM], total_norm, evidence, pending.batch)

        return StepRecord(
            step=pending.step,
            wall_time=pending.wall_time,
            layers=layers,
            stats=stats,
            total_norm=total_norm,
            histograms=self.part("histograms", lambda: self._histograms(pending.parts), {}),
            model_name=self.model_name,
            layer_metrics=self._layer_metrics,
            layer_detail="all" if pending.per_layer else "none",
            dropped_steps=0 if self.drops is None else self.drops.total,
            skipped_by=pending.skipped_by,
            skipped_steps=pending.skipped_steps,
            **(pending.origin or {}),
            **(spike_fields(spike) if len(spike) else {}),
            **self.update_fields(pending.update, layers),
            **self.part("step evidence", lambda: _evidence_fields(evidence), _NONE),
            **self.part(
                "activation gradients",
                lambda: self._activations(activations, pending.activation_order or []),
                _NONE,
            ),
            **self.part("rank norms", lambda: self._ranks(evidence, layers), _NONE),
            **self.part("noise scale", noise, _NONE),
        )

    def update_fields(self, update: UpdateRows | None, layers: tuple[str, ...]) -> dict[str, Any]:
        """``param_norms`` and ``update_norms`` for ``layers``, from the step's update rows
        (none without them; a failure is reported once and costs only these fields)."""
        if update is None:
            return {}

        def norms() -> dict[str, Any]:
            if isinstance(update, FlatUpdate):
                rows = update.rows()
            else:
                buffer, ready = update
                if ready is not None:
                    ready.synchronize()
                rows = buffer.numpy()
            params, updates = self._index.layer_update_norms(rows)
            order = [self._layer_position[name] for name in layers]
            return {"param_norms": params[order], "update_norms": updates[order]}

        return self.part("update signals", norms, _NONE)

    def part(self, name: str, build: Callable[[], T], fallback: T) -> T:
        """One optional part of a step; a failure is reported once and costs only it."""
        try:
            return build()
        except Exception as exc:  # a bug in one part must not take the step's rules with it
            self.part_errors[name] = self.part_errors.get(name, 0) + 1
            if self.part_errors[name] == 1:
                report(f"gradtrack could not build the {name} of a step: {exc!r}; the rest goes on")
            return fallback

    def _ranks(self, evidence: HostEvidence, layers: tuple[str, ...]) -> dict[str, Any]:
        """Replicated ranks' local (pre-all-reduce) gradients: who went non-finite, and with
        ``gather_ranks`` each rank's layer norms."""
        if self._mesh is not None:
            return self._mesh.nonfinite_fields(evidence.rank_flags)
        local_norms = evidence.rank_norms
        if not self._world_size or len(local_norms) == 0:
            return {}
        index = self._index
        per_tensor = local_norms.reshape(self._world_size, -1)
        bad = ~np.isfinite(per_tensor).all(axis=1)
        fields: dict[str, Any] = {"nonfinite_ranks": tuple(bad.nonzero()[0].tolist())}
        if self._gather_ranks:
            per_layer = index.rank_layer_norms(per_tensor)
            position = self._layer_position
            fields["rank_grad_norms"] = per_layer[:, [position[name] for name in layers]]
        return fields

    def _activations(self, norms: np.ndarray, order: list[int]) -> dict[str, Any]:
        if not self._activation_names or len(norms) == 0:
            return {}
        names = self._activation_names
        arrived = set(order)
        observed = {names[i]: float(v) for i, v in enumerate(norms) if i in arrived}
        first_bad = next((names[i] for i in order if not np.isfinite(norms[i])), None)
        return {"activation_grad_norms": observed, "activation_origin": first_bad}

    def _histograms(self, parts: Sequence[HostPart]) -> dict[str, Histogram]:
        per_layer: dict[int, list[np.ndarray]] = {}
        for part in parts:
            if part.sample_counts is None:
                continue
            layer_of = self._index.tensor_layer[part.tensor_index]
            pieces = np.split(part.samples(), np.cumsum(part.sample_counts)[:-1])
            for layer, piece in zip(layer_of.tolist(), pieces):
                per_layer.setdefault(layer, []).append(piece)
        histograms = {}
        for layer, pieces in sorted(per_layer.items()):
            histogram = bin_samples(np.concatenate(pieces), self._hist_bins, self._hist_scale)
            if histogram is not None:
                histograms[self._index.layer_names[layer]] = histogram
        return histograms


def _evidence_fields(evidence: HostEvidence) -> dict[str, Any]:
    """StepRecord fields from the step's scalar evidence (None where unknown)."""
    output = evidence.scalar("output_finite")
    output_grad = evidence.scalar("output_grad_finite")
    found_inf = evidence.scalar("amp_found_inf")
    return {
        "output_finite": None if output is None else bool(output),
        "output_grad_finite": None if output_grad is None else bool(output_grad),
        "output_grad_norm": evidence.scalar("output_grad_norm"),
        "amp_skipped": None if found_inf is None else found_inf > 0,
        "amp_scale": evidence.scalar("amp_scale"),
        "amp_scale_after": evidence.scalar("amp_scale_after"),
    }
