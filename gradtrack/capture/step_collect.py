"""A planned step collected into the `PendingStep` the worker gets: its reductions and host
copy launched (`gradtrack.capture.collect`), its evidence attached, and, for a non-finite
step, where it was made (`gradtrack.capture.origin`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gradtrack.capture.collect import Collector
from gradtrack.capture.distributed import RankGroup
from gradtrack.capture.flight_ring import FlightRecorder
from gradtrack.capture.origin import nonfinite_weight_layers
from gradtrack.capture.probes import Probes
from gradtrack.capture.verdict import StepPlan
from gradtrack.handoff.pending import PendingStep

OnError = Callable[[int, Exception], None]


class StepCollector:
    """Collects planned steps on this rank; rank 0 (or the one process) hands them on."""

    def __init__(
        self,
        collector: Collector,
        ranks: RankGroup | None,
        flight: FlightRecorder | None,
        on_error: OnError,
    ) -> None:
        self.collector = collector
        self.ranks = ranks
        self.flight = flight
        self._on_error = on_error

    def origin_of(self, plan: StepPlan, probes: Probes) -> dict[str, Any] | None:
        """Where a non-finite step came from, where it is summarised or judged now: are the
        weights already non-finite (an earlier bad update was applied)? If not, and the step
        is the first bad one of its window, judged now or skipped, which module made it (a
        replay of its forward and backward)."""
        replay = plan.first_bad or plan.judge_now or plan.skip is not None
        if not plan.bad or not (plan.due or replay):
            return None
        try:
            collector, probe = self.collector, probes.origin
            weights = nonfinite_weight_layers(
                collector.index.layer_names, collector.params, collector.index.tensor_layer
            )
            fields: dict[str, Any] = {"nonfinite_weights": weights}
            if not weights and replay and probe is not None:
                found = probe.locate()
                fields.update(
                    origin_module=found.module,
                    origin_module_stage=found.stage,
                    origin_note=found.note,
                )
            return fields
        except Exception as exc:  # watching must never crash training
            self._on_error(plan.step, exc)
            return None

    def pending(
        self,
        plan: StepPlan,
        probes: Probes,
        backward_order: list[int] | None,
        evidence_parts: tuple[torch.Tensor | None, torch.Tensor | None],
        origin: dict[str, Any] | None,
    ) -> PendingStep | None:
        """Launch the step's reductions and its copy to the host; None if this rank hands
        nothing to a worker (another rank writes, or collecting failed). Max and mean |g| are
        computed only on ``plan.per_layer`` steps: they cost two more passes over every
        gradient. The replicated ranks' local norms are gathered on due steps only (the probe
        takes them then; every rank agrees on a bad step, whose gradients are all-reduced)."""
        ranks = self.ranks
        try:
            rank_norms = None
            if probes.local is not None and ranks is not None and plan.due:
                # The step's one collective: every replicated rank's local norms, to rank 0.
                local = probes.local.take(self.collector.params[0].device)
                rank_norms = ranks.all_gather(local).reshape(-1)
            if ranks is not None and ranks.rank != 0 and ranks.layout != "sharded":
                return None
            evidence, activation_order = probes.evidence()
            evidence.rank_norms = rank_norms
            evidence.spike, evidence.latch = evidence_parts
            if self.flight is not None:
                evidence.flight = self.flight.take()
            parts = self.collector.collect(
                plan.guard, plan.with_samples, evidence, full=plan.per_layer
            )
        except Exception as exc:  # watching must never crash training
            self._on_error(plan.step, exc)
            return None
        if not parts or (ranks is not None and ranks.rank != 0):
            return None  # (sharded: this rank's shard rows went into rank 0's)
        return PendingStep(
            plan.step, time.time(), parts, backward_order, activation_order,
            per_layer=plan.per_layer, origin=origin,
            skipped_by=None if plan.skip is None else plan.skip.rule,
            skipped_steps=plan.skipped_steps, batch=probes.batch,
        )  # fmt: skip

    def closing(
        self, step: int, outcome: str, read_latch: Callable[[], np.ndarray | None]
    ) -> PendingStep | None:
        """At close (a read of the device): the bad step latched after the last logged one,
        and the recorder's last steps where training ended in an exception or Ctrl-C."""
        if self.ranks is not None and self.ranks.rank != 0:
            return None
        try:
            latch, flight = read_latch(), self.flight
            if latch is not None and self.ranks is not None and self.ranks.layout == "sharded":
                # Rank 0's own pieces only (no collective at close): what it knows for sure
                # is which tensors went non-finite, not the others' full norms.
                n = len(self.collector.params)
                norms = latch[1 : 1 + n]
                latch[1 : 1 + n] = np.where(np.isfinite(norms), -1.0, norms)
            ending = None if outcome == "FINISHED" else outcome
            if latch is None and (ending is None or flight is None):
                return None
            last = PendingStep(step, time.time(), [], ending=ending, latch=latch)
            last.flight_rows = None if flight is None else flight.take_on_host()
            return last
        except Exception as exc:  # watching must never crash training
            self._on_error(step, exc)
            return None
