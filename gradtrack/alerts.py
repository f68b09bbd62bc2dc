"""Alert rules applied to step records: pure logic, `StepRecord` in, `AlertEvent`s out.

Each message carries a diagnosis — the likely cause and what to try — from the evidence.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from gradtrack.layers import SPARSE_KINDS
from gradtrack.record import StepRecord
from gradtrack.rules import AlertRules, Severity

Stage = Literal["forward", "loss", "backward", "weights"]


class AlertEvent(BaseModel):
    """One alert: what tripped, where, by how much, and what to do about it.

    ``origin_layer`` / ``origin_stage`` say where non-finite gradients were made (see
    `gradtrack.origin`): ``"forward"`` — the first module, in execution order, whose output
    was non-finite (None: the input batch already was); ``"loss"`` — the gradient reaching
    the model output was; ``"backward"`` — the innermost module whose input gradient was
    non-finite while its output gradient was finite (any module, not only a layer; without a
    replay, the non-finite layer nearest the loss); ``"weights"`` — the weights were already
    non-finite (an earlier bad update was applied): the first such layer.

    Per-layer rules that trip in several layers at one step make one event: ``layers`` names
    them all (depth order), ``layer``/``value``/``threshold`` are the worst of them.
    """

    model_config = ConfigDict(frozen=True, ser_json_inf_nan="constants")

    step: int
    wall_time: float
    rule: str
    layer: str | None
    statistic: str
    value: float
    threshold: float | None
    severity: Severity
    message: str
    rank: int = 0
    ranks: tuple[int, ...] | None = None  # DDP: ranks whose local gradient was non-finite
    origin_layer: str | None = None
    origin_stage: Stage | None = None
    layers: tuple[str, ...] = ()  # every layer it covers (non-finite: all); () if whole-model
    # Within its rule's cooldown: not notified (sinks, logs, callbacks never see it), made
    # only so that a rule whose action is "raise" raises every time.
    silenced: bool = False

    @property
    def title(self) -> str:
        where = f" in {self.layer}" if self.layer else ""
        if len(self.layers) > 1:
            where += f" and {len(self.layers) - 1} more layers"
        return f"gradtrack: {self.rule}{where}"


class AlertEngine:
    """Keeps the per-layer state rules need (patience runs, running averages, cooldowns)."""

    def __init__(
        self,
        rules: AlertRules,
        depth_order: Sequence[str],
        rank: int = 0,
        kinds: Sequence[str] | None = None,
        saturating: Sequence[bool] | None = None,
    ) -> None:
        """``kinds``: per layer, what it is compared with (`gradtrack.layers.layer_kinds`;
        default: all alike); ``saturating``: per layer, whether zero gradients there read as
        saturated tanh/sigmoid rather than dead ReLUs (`gradtrack.layers.saturating_layers`)."""
        self.rules = rules
        self.rank = rank
        self._names = list(depth_order)
        self._depth = {name: i for i, name in enumerate(depth_order)}
        self._kinds = list(kinds) if kinds is not None else ["layer"] * len(depth_order)
        self._saturating = list(saturating or [False] * len(depth_order))
        self._flow_run = 0  # logged steps in a row the flow rule tripped, signed by direction
        self._last_bad_gradient: int | None = None  # the last step with a non-finite gradient
        self._weights_bad_since: int | None = None  # the first step whose weights were
        self._params: dict[tuple[str, str], np.ndarray] = {}
        self._vanishing_runs = np.zeros(len(depth_order), dtype=np.int64)
        self._dead_runs = np.zeros(len(depth_order), dtype=np.int64)
        self._update_runs = np.zeros(len(depth_order), dtype=np.int64)
        self._backward_position: dict[str, int] = {}
        self._cache: dict[tuple[str, str | None], Any] = {}
        self._last_fired: dict[tuple[str, str | None], int] = {}
        self._total_norms: deque[float] = deque(maxlen=1000)
        self._amp_skips = 0

    def set_backward_order(self, layers: Sequence[str]) -> None:
        """Layers in the order their gradients became ready in a backward pass."""
        self._backward_position = {name: i for i, name in enumerate(layers)}

    def rule(self, name: str, layer: str | None) -> Any:
        key = (name, layer)
        if key not in self._cache:
            self._cache[key] = self.rules.for_layer(name, layer)
        return self._cache[key]

    def evaluate(self, record: StepRecord) -> list[AlertEvent]:
        events: list[AlertEvent] = []
        if record.amp_skipped is not None:
            events += self._amp(record)
        if not record.amp_skipped:
            events += self._nonfinite(record)
        events += self._layer_rules(record)
        events += self._exploding(record, None, record.total_norm)
        events += self._spike(record) + self._update_ratio(record)
        jumps = self._jump(record)
        events += jumps + self._flow(record, broken={self._kind(e.layer) for e in jumps})
        if math.isfinite(record.total_norm):
            self._total_norms.append(record.total_norm)
        events = self._merge_layers(events)
        return self._skipped(record, events) if record.skipped_by else events

    def _kind(self, layer: str | None) -> str | None:
        return None if layer is None else self._kinds[self._depth[layer]]

    # -- helpers ---------------------------------------------------------------------------
    def _emit(
        self, record: StepRecord, rule_name: str, layer: str | None, **fields: Any
    ) -> list[AlertEvent]:
        rule = self.rule(rule_name, layer)
        last = self._last_fired.get((rule_name, layer))
        # A step left out of training is told every time (each skip is an event).
        silenced = last is not None and record.step - last <= rule.cooldown_steps
        silenced &= record.skipped_by != rule_name
        if silenced and rule.action != "raise":
            return []
        if not silenced:
            self._last_fired[(rule_name, layer)] = record.step
        fields.setdefault("severity", rule.severity)
        fields.setdefault("layers", (layer,) if layer else ())
        event = AlertEvent(
            step=record.step, wall_time=record.wall_time, rule=rule_name, layer=layer,
            rank=self.rank, silenced=silenced, **fields,
        )  # fmt: skip
        return [event]

    def _merge_layers(self, events: list[AlertEvent]) -> list[AlertEvent]:
        """One event per rule (and severity, action) for the layers that tripped together.

        A deep model whose gradient vanishes trips the rule in hundreds of layers at once;
        that is one finding, and a tracker that notifies per alert must see it once.
        """
        slots: dict[tuple[str, str, str, str], int] = {}  # group → its place in the output
        groups: list[list[AlertEvent]] = []
        for event in events:
            if event.rule == "nonfinite" or event.layer is None:
                groups.append([event])
                continue
            action = self.rule(event.rule, event.layer).action
            key = (event.rule, event.severity, action, str(event.silenced))
            if key not in slots:
                slots[key] = len(groups)
                groups.append([])
            groups[slots[key]].append(event)
        return [group[0] if len(group) == 1 else _merged(group, self._depth) for group in groups]

    # -- rules -----------------------------------------------------------------------------
    def _nonfinite(self, record: StepRecord) -> list[AlertEvent]:
        nan_counts, inf_counts = record.column("nan"), record.column("inf")
        norms = record.column("norm")  # exact: non-finite only where an element is
        rows = np.flatnonzero((nan_counts > 0) | (inf_counts > 0) | ~np.isfinite(norms))
        if len(rows) == 0 or not self.rule("nonfinite", None).enabled:
            return []
        bad = [record.layers[j] for j in rows]
        origin, stage = self.nonfinite_origin(record, bad)
        nan, inf = int(nan_counts[rows].sum()), int(inf_counts[rows].sum())
        kind = "NaN" if nan or np.isnan(norms[rows]).any() else "Inf"
        where, advice = self._nonfinite_diagnosis(record, origin, stage)
        counts = f"{nan} NaN and {inf} Inf in {len(bad)} layer(s): {', '.join(bad[:8])}"
        if not record.counted:
            counts = (
                f"{kind} in {len(bad)} layer(s): {', '.join(bad[:8])} (elements not counted: "
                "a step between logged steps, latched on the accelerator)"
            )
        if record.activation_origin is not None:
            counts += (
                "; the first non-finite activation gradient was at the output of "
                f"{record.activation_origin}, so it arose in the backward of what follows it"
            )
        ranks = record.nonfinite_ranks
        if ranks and record.nonfinite_rank_places:
            counts += (
                f"; it arose on rank(s) {', '.join(record.nonfinite_rank_places)}, whose model "
                "output or its gradient was non-finite — look at that batch"
            )
        elif ranks:
            counts += (
                f"; before the all-reduce it was non-finite on rank(s) "
                f"{', '.join(map(str, ranks))} only — look at that rank's batch"
                if len(ranks) == 1
                else f"; before the all-reduce it was non-finite on ranks {list(ranks)}"
            )
        elif ranks is not None:
            counts += "; every rank's local gradient was finite: the all-reduce overflowed"
        message = f"{kind} gradient {where}. {counts}. Try: {advice}."
        if stage == "weights":
            message = self._weights_message(record, kind, counts)
        elif record.origin_note and not record.origin_note.startswith("the input batch"):
            message += f" {record.origin_note[0].upper()}{record.origin_note[1:]}."
        if stage != "weights":
            self._last_bad_gradient = record.step
        return self._emit(
            record, "nonfinite", origin,
            statistic=("nan_count" if nan else "inf_count") if record.counted else "layers",
            value=float(nan or inf) if record.counted else float(len(bad)),
            threshold=0.0, message=message,
            origin_layer=origin, origin_stage=stage, ranks=ranks, layers=tuple(bad),
        )  # fmt: skip

    def _weights_message(self, record: StepRecord, kind: str, counts: str) -> str:
        weights = record.nonfinite_weights or ()
        if self._weights_bad_since is None:
            self._weights_bad_since = record.step
        last = self._last_bad_gradient
        if last is not None and last < self._weights_bad_since:
            since = (
                f"since step {last + 1}: the update of step {last}, whose gradient was "
                "non-finite, was applied"
            )
            fix = f"fix what made step {last}'s gradient (its event says where)"
        else:
            since = f"since step {self._weights_bad_since} or earlier"
            fix = "find the first non-finite step (grad/nan_count, grad/inf_count)"
        shown = ", ".join(weights[:8]) + (
            f" and {len(weights) - 8} more" if len(weights) > 8 else ""
        )
        return (
            f"{kind} gradient because the weights are non-finite: {shown} "
            f"({len(weights)} layer(s)) hold NaN/Inf {since}. Every forward and backward "
            f"since is non-finite, whatever the batch: the run cannot recover by itself. "
            f"{counts}. Try: stop, restore a checkpoint from before that step, {fix}, and keep "
            "bad updates out of the weights: alerts={'nonfinite': {'action': 'raise'}}, "
            "gradient clipping, or a GradScaler (it skips non-finite steps)."
        )

    @staticmethod
    def _nonfinite_diagnosis(
        record: StepRecord, origin: str | None, stage: Stage
    ) -> tuple[str, str]:
        """Where it arose, and what to try (the seed's fix column: an eps or a clamp on the
        op that made it, a GradScaler under fp16)."""
        fix = (
            "an eps or a clamp where a log, sqrt or division meets 0 or a negative "
            "(torch.log(x.clamp_min(1e-8)), torch.sqrt(x + 1e-8), x / (y + 1e-8)), "
            "exp/pow overflow, and under fp16 AMP a GradScaler (or bf16)"
        )
        if stage == "weights":
            return "", ""
        if stage == "forward" and record.origin_note.startswith("the input batch"):
            return (
                "from the input batch: it already held NaN/Inf (forward pass)",
                "check the data pipeline (missing values, a division in preprocessing): "
                "torch.isfinite(batch).all() where the batch is made",
            )
        if stage == "forward":
            made = f" at {origin}'s output" if record.origin_module else ""
            return (
                f"made in the forward pass{made} (the model output was already non-finite)",
                f"look at {origin}'s forward: {fix}; and the input batch for NaN/Inf"
                if record.origin_module
                else f"the input batch for NaN/Inf and the forward numerics: {fix}",
            )
        if stage == "loss":
            return (
                "the gradient reaching the model output was already non-finite (loss)",
                f"the loss produced it (log(0), division by zero, sqrt of 0, targets outside "
                f"the loss's range): {fix}; prefer fused losses (cross_entropy on logits, "
                "binary_cross_entropy_with_logits)",
            )
        return (
            f"first at {origin} (backward; model output finite)",
            f"look at the ops in {origin}'s backward: {fix}; then the learning rate (lower it, "
            "or clip the gradient norm)",
        )

    def nonfinite_origin(self, record: StepRecord, bad: list[str]) -> tuple[str | None, Stage]:
        if record.nonfinite_weights:
            return record.nonfinite_weights[0], "weights"
        if record.origin_module_stage in ("loss", "forward") and record.origin_module is None:
            return None, record.origin_module_stage  # type: ignore[return-value]
        if record.origin_module is not None and record.origin_module_stage is not None:
            return record.origin_module, record.origin_module_stage  # type: ignore[return-value]
        if record.output_finite is False:
            stage: Stage = "forward"
        elif record.output_grad_finite is False:
            stage = "loss"
        else:
            stage = "backward"
        if not bad:
            return None, stage
        unknown = len(self._backward_position)
        # Nearest the loss: first in backward order; never seen there → deepest in the model.
        origin = min(
            bad,
            key=lambda layer: (
                self._backward_position.get(layer, unknown),
                -self._depth.get(layer, 0),
            ),
        )
        return origin, stage

    def _layer_rules(self, record: StepRecord) -> list[AlertEvent]:
        """Per-layer rules over all layers at once; Python work only for the layers that trip."""
        idx = np.fromiter(
            (self._depth[name] for name in record.layers), np.int64, len(record.layers)
        )
        norms = record.column("norm")
        finite = np.isfinite(norms)
        events: list[AlertEvent] = []
        explodes = (
            self._enabled("exploding", idx)
            & finite
            & (norms > self._param("exploding", "threshold", idx))
        )
        for j in np.flatnonzero(explodes):
            events += self._exploding(record, record.layers[j], float(norms[j]))

        active = self._enabled("vanishing", idx) & finite
        threshold = self._param("vanishing", "threshold", idx)
        runs = self._advance(self._vanishing_runs, idx, active, (norms > 0) & (norms < threshold))
        for j in np.flatnonzero(active & (runs >= self._param("vanishing", "patience", idx))):
            layer, norm = record.layers[j], float(norms[j])
            events += self._emit(
                record, "vanishing", layer, statistic="norm", value=norm,
                threshold=float(threshold[j]),
                message=(
                    f"gradient norm of {layer} is {norm:.3g}, below {threshold[j]:.3g} "
                    f"for {runs[j]} logged steps: it barely learns. Try: residual connections, "
                    "normalisation (LayerNorm/BatchNorm), a better initialisation "
                    "(Kaiming/Xavier), or non-saturating activations (ReLU/GELU instead of "
                    "sigmoid/tanh)."
                ),
            )  # fmt: skip

        active = self._enabled("dead", idx) & finite
        runs = self._advance(self._dead_runs, idx, active, norms == 0.0)
        live = finite & (norms > 0)
        for j in np.flatnonzero(active & (runs >= self._param("dead", "patience", idx))):
            events += self._dead(record, int(j), int(runs[j]), live)
        return events

    def _dead(self, record: StepRecord, j: int, run: int, live: np.ndarray) -> list[AlertEvent]:
        layer = record.layers[j]
        # Where the flow stops: the deepest dead layer whose next layer still gets gradient.
        after = record.layers[j + 1] if j + 1 < len(record.layers) and live[j + 1] else None
        where = (
            f" The flow stops here: {after}, right after it, still gets gradient, so look at "
            f"what {layer} feeds (its activation) first."
            if after
            else ""
        )
        if self._saturating[self._depth[layer]]:
            cause = (
                "Likely: saturated tanh/sigmoid units — their derivative is exactly 0 in "
                "float32 once |x| is large (tanh beyond ~9). Try: scaling or normalising the "
                "inputs, a smaller initialisation, LayerNorm before the nonlinearity, gradient "
                "clipping; or an unintended freeze (a .detach(), torch.no_grad() or "
                "requires_grad=False upstream of this layer)."
            )
        else:
            cause = (
                "Likely: dying ReLUs — every unit's input is negative. Try: LeakyReLU/GELU, a "
                "lower learning rate, and a bias initialisation that keeps units on (zero or "
                "slightly positive; a large negative bias switches them off); or an unintended "
                "freeze (a .detach(), torch.no_grad() or requires_grad=False upstream of this "
                "layer)."
            )
        return self._emit(
            record, "dead", layer, statistic="norm", value=0.0, threshold=0.0,
            message=(
                f"gradient of {layer} has been exactly zero for {run} logged steps.{where} "
                f"{cause}"
            ),
        )  # fmt: skip

    def _param(self, rule: str, field: str, idx: np.ndarray) -> np.ndarray:
        """One rule field for every layer (per-layer overrides applied), at ``idx``."""
        key = (rule, field)
        if key not in self._params:
            values = [float(getattr(self.rule(rule, name), field)) for name in self._names]
            self._params[key] = np.array(values, dtype=np.float64)
        return self._params[key][idx]

    def _enabled(self, rule: str, idx: np.ndarray) -> np.ndarray:
        return self._param(rule, "enabled", idx) > 0

    @staticmethod
    def _advance(
        runs: np.ndarray, idx: np.ndarray, active: np.ndarray, hit: np.ndarray
    ) -> np.ndarray:
        """Consecutive-hit counters of the active layers: +1 on a hit, back to 0 otherwise."""
        updated = np.where(hit, runs[idx] + 1, 0)
        runs[idx[active]] = updated[active]
        return updated

    def _exploding(self, record: StepRecord, layer: str | None, norm: float) -> list[AlertEvent]:
        rule = self.rule("exploding", layer)
        if not rule.enabled or not math.isfinite(norm) or norm <= rule.threshold:
            return []  # non-finite norms belong to the nonfinite rule
        history = [n for n in self._total_norms if n <= rule.threshold]
        clip = float(np.percentile(history, 90)) if history else rule.threshold / 10
        name = layer or "the total gradient"
        return self._emit(
            record, "exploding", layer, statistic="norm" if layer else "total_norm",
            value=norm, threshold=rule.threshold,
            message=(
                f"gradient norm of {name} is {norm:.3g}, above {rule.threshold:.3g}. Try: a lower "
                "learning rate, or clipping: torch.nn.utils.clip_grad_norm_(model.parameters(), "
                f"max_norm={clip:.2g}) (the 90th percentile of the total norms seen so far)."
            ),
        )  # fmt: skip

    def _spike(self, record: StepRecord) -> list[AlertEvent]:
        """The columns `gradtrack.spike.NormWindow` flagged at this step, on the device (every
        step; a step between logged ones reaches here when it spiked)."""
        if record.spiking is None or record.spike_z is None or record.spike_typical is None:
            return []
        events: list[AlertEvent] = []
        window = self.rules.spike.window
        for column in np.flatnonzero(record.spiking):
            layer = None if column == 0 else self._names[column - 1]
            z, typical = float(record.spike_z[column]), float(record.spike_typical[column])
            name = layer or "the total gradient"
            norm = record.total_norm if layer is None else _layer_norm(record, layer)
            rule = self.rule("spike", layer)
            events += self._emit(
                record, "spike", layer, statistic="norm" if layer else "total_norm",
                value=norm, threshold=typical * rule.ratio,
                message=(
                    f"gradient norm of {name} spiked to {norm:.3g} at step {record.step}: "
                    f"{norm / typical:.1f}x its typical {typical:.3g} over the last {window} "
                    f"steps, {z:.1f} standard deviations above (log scale). Gradient-norm "
                    "spikes come before loss spikes: a bad batch (look at this step's data), "
                    "a learning rate too high for this phase (a longer warmup), or Adam's "
                    "epsilon too small. Try: clipping, or alerts={'spike': {'action': 'skip'}} "
                    "to leave such steps out."
                ),
            )  # fmt: skip
        return events

    def _update_ratio(self, record: StepRecord) -> list[AlertEvent]:
        """Layers that learn far too fast or barely at all, for ``patience`` logged steps."""
        ratios = record.update_ratios()
        if ratios is None:
            return []
        idx = np.fromiter((self._depth[n] for n in record.layers), np.int64, len(record.layers))
        active = self._enabled("update_ratio", idx) & np.isfinite(ratios)
        high, low = (
            self._param("update_ratio", "high", idx),
            self._param("update_ratio", "low", idx),
        )
        fast, slow = ratios > high, (ratios > 0) & (ratios < low)
        runs = self._advance(self._update_runs, idx, active, fast | slow)
        events: list[AlertEvent] = []
        for j in np.flatnonzero(active & (runs >= self._param("update_ratio", "patience", idx))):
            layer, ratio = record.layers[j], float(ratios[j])
            if fast[j]:
                threshold, finding = (
                    float(high[j]),
                    (
                        f"each step moves {layer}'s weights by {ratio:.3g} of their norm, above "
                        f"{high[j]:.3g}, for {runs[j]} logged steps: it learns too fast (healthy "
                        "layers sit near 1e-3). Try: a lower learning rate for it (a parameter "
                        "group), a longer warmup, or clipping."
                    ),
                )
            else:
                threshold, finding = (
                    float(low[j]),
                    (
                        f"each step moves {layer}'s weights by only {ratio:.3g} of their norm, "
                        f"below {low[j]:.3g}, for {runs[j]} logged steps: it barely learns "
                        "(healthy layers sit near 1e-3). Try: a higher learning rate for it, a "
                        "smaller weight decay, Adam's eps below the gradient's scale, or check it "
                        "is not meant to be frozen."
                    ),
                )
            events += self._emit(
                record, "update_ratio", layer, statistic="update_ratio", value=ratio,
                threshold=threshold, message=finding,
            )  # fmt: skip
        return events

    def _skipped(self, record: StepRecord, events: list[AlertEvent]) -> list[AlertEvent]:
        """The event of a skipped step says so; a skip no rule event explains still is one."""
        note = (
            f" The optimizer step was skipped (action='skip'): weights and optimizer state "
            f"are unchanged; {record.skipped_steps} step(s) skipped so far."
        )
        rule = record.skipped_by
        for i, event in enumerate(events):
            if event.rule == rule:
                events[i] = event.model_copy(update={"message": event.message + note})
                return events
        severity = self.rule(rule or "nonfinite", None).severity
        fallback = AlertEvent(
            step=record.step, wall_time=record.wall_time, rule=rule or "skip", layer=None,
            statistic="total_norm", value=record.total_norm, threshold=None, severity=severity,
            rank=self.rank, message=f"step {record.step} tripped {rule} at its guard.{note}",
        )  # fmt: skip
        return [*events, fallback]

    def _comparable(self, record: StepRecord) -> dict[str, np.ndarray]:
        """Rows (depth order) with a finite, non-zero gradient RMS, per kind of layer; layers
        with row-sparse gradients (embeddings) are compared with nothing."""
        rms = record.column("rms")
        by_kind: dict[str, list[int]] = {}
        for j in np.flatnonzero(np.isfinite(rms) & (rms > 0)):
            kind = self._kinds[self._depth[record.layers[j]]]
            if kind not in SPARSE_KINDS:
                by_kind.setdefault(kind, []).append(int(j))
        return {kind: np.array(rows) for kind, rows in by_kind.items() if len(rows) > 1}

    def _jump(self, record: StepRecord) -> list[AlertEvent]:
        """Where every layer of a kind on one side of a depth is ``ratio`` below every layer
        of that kind on the other: an envelope, so that one layer that is small by nature
        (a query projection at initialisation) next to normal ones is no break."""
        rms = record.column("rms")
        events: list[AlertEvent] = []
        for kind, rows in self._comparable(record).items():
            values = rms[rows]
            above_max = np.maximum.accumulate(values)[:-1]  # layers nearer the input
            above_min = np.minimum.accumulate(values)[:-1]
            below_min = np.minimum.accumulate(values[::-1])[::-1][1:]  # nearer the loss
            below_max = np.maximum.accumulate(values[::-1])[::-1][1:]
            starved, flooded = below_min / above_max, above_min / below_max
            upstream_weak = starved >= flooded  # else the side nearer the loss is the weak one
            boundary = np.arange(len(rows) - 1)
            weak = np.where(upstream_weak, boundary, boundary + 1)
            idx = np.fromiter(
                (self._depth[record.layers[j]] for j in rows[weak]), np.int64, len(weak)
            )
            ratio = np.maximum(starved, flooded)
            limit = self._param("jump", "ratio", idx)
            for k in np.flatnonzero(self._enabled("jump", idx) & (ratio > limit)):
                up = bool(upstream_weak[k])
                strong = k + 1 if up else k
                a, b = record.layers[rows[weak[k]]], record.layers[rows[strong]]
                low, high = (above_max[k], below_min[k]) if up else (below_max[k], above_min[k])
                side, other = ("up to", "from") if up else ("from", "up to")
                events += self._emit(
                    record, "jump", a, statistic="rms_ratio", value=float(ratio[k]),
                    threshold=float(limit[k]),
                    message=(
                        f"gradient flow breaks between {a} and {b}: every {kind} layer {side} "
                        f"{a} has a gradient RMS of at most {low:.3g}, {ratio[k]:.3g}× below "
                        f"every {kind} layer {other} {b} (at least {high:.3g}). {a} is the weak "
                        "side. Look at what lies between them: a scale far from 1 (a tiny "
                        "constant, a near-zero initialisation), a saturating activation, a "
                        ".detach(), or a missing residual path or normalisation."
                    ),
                )  # fmt: skip
        return events

    def _flow(self, record: StepRecord, broken: set[str | None]) -> list[AlertEvent]:
        """The seed's profile, first layers over last, compared like with like: per *role* —
        a kind of layer at one place in a repeated block (``blocks.#.attn.q``; every layer of
        a plain stack) with at least 3 layers — the geometric-mean gradient RMS of its first
        quarter over its last quarter; the model's ratio is the median role's. Query and key
        projections, small by nature, are so compared only with each other."""
        rule = self.rule("flow", None)
        comparable = self._comparable(record)
        if not rule.enabled or not comparable:
            return []
        rms = record.column("rms")
        roles: dict[tuple[str, str], list[int]] = {}
        for kind, kind_rows in comparable.items():
            for j in kind_rows:
                role = (kind, _DIGITS.sub("#", record.layers[j]))
                roles.setdefault(role, []).append(int(j))
        profiles = []  # (log ratio, kind, rows in depth order)
        for (kind, _), role_rows in roles.items():
            if len(role_rows) >= 3:
                quarter = max(1, len(role_rows) // 4)
                head, tail = rms[role_rows[:quarter]], rms[role_rows[-quarter:]]
                profiles.append((np.log(head).mean() - np.log(tail).mean(), kind, role_rows))
        if not profiles:
            self._flow_run = 0
            return []
        profiles.sort(key=lambda profile: profile[0])
        log_ratio, kind, role_rows = profiles[(len(profiles) - 1) // 2]  # the median role
        rows = np.array(role_rows)
        quarter = max(1, len(rows) // 4)
        ratio = float(np.exp(log_ratio))
        direction = -1 if ratio < 1 / rule.ratio else 1 if ratio > rule.ratio else 0
        if direction == 0 or kind in broken:  # a break is the jump rule's finding
            self._flow_run = 0
            return []
        same = self._flow_run * direction > 0
        self._flow_run = self._flow_run + direction if same else direction
        if abs(self._flow_run) < rule.patience:
            return []
        names = [record.layers[j] for j in rows]
        layer, statistic = names[0], "flow_ratio"  # the starving (or flooded) end
        first_names, last_names = ", ".join(names[:quarter]), ", ".join(names[-quarter:])
        decades = abs(math.log10(ratio))
        span = f"across {len(rows)} {kind} layers, {decades:.1f} decades"
        if direction < 0:
            message = (
                f"gradient vanishes along depth: the first {kind} layers ({first_names}) get "
                f"{ratio:.3g}× the gradient RMS of the last ones ({last_names}) — {span} lost "
                f"gradually, for {abs(self._flow_run)} logged steps: the first layers barely "
                "learn. Try: non-saturating activations (ReLU/GELU instead of sigmoid/tanh), "
                "residual connections, normalisation (LayerNorm/BatchNorm), and a "
                "variance-preserving initialisation (Kaiming for ReLU, Xavier for tanh)."
            )
        else:
            history = list(self._total_norms)
            clip = float(np.percentile(history, 50)) if history else 1.0
            message = (
                f"gradient explodes along depth: the first {kind} layers ({first_names}) get "
                f"{ratio:.3g}× the gradient RMS of the last ones ({last_names}) — {span} "
                f"gained, for {abs(self._flow_run)} logged steps. Try: clipping, "
                f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={clip:.2g}) (the "
                "median total norm so far), a lower learning rate, normalisation "
                "(LayerNorm/BatchNorm), or a smaller initialisation."
            )
        return self._emit(
            record, "flow", layer, statistic=statistic, value=ratio,
            threshold=1 / rule.ratio if direction < 0 else rule.ratio, message=message,
        )  # fmt: skip

    def _amp(self, record: StepRecord) -> list[AlertEvent]:
        rule = self.rule("amp", None)
        if not record.amp_skipped:
            self._amp_skips = 0
            return []
        self._amp_skips += 1
        if not rule.enabled:
            return []
        before, after = record.amp_scale, record.amp_scale_after
        change = f"scale {before:g}→{after:g}" if before is not None else "scale reduced"
        if self._amp_skips >= rule.max_skips:
            return self._emit(
                record, "amp", None, statistic="skipped_steps", value=float(self._amp_skips),
                threshold=float(rule.max_skips),
                message=(
                    f"GradScaler skipped {self._amp_skips} steps in a row ({change}): the "
                    "gradients overflow whatever the scale. The model itself produces Inf/NaN: "
                    "check the forward numerics, lower the learning rate, or train in bf16."
                ),
            )  # fmt: skip
        return self._emit(
            record, "amp", None, statistic="skipped_steps", value=float(self._amp_skips),
            threshold=float(rule.max_skips), severity="info",
            message=f"overflow: step skipped, {change}",
        )  # fmt: skip


def _layer_norm(record: StepRecord, layer: str) -> float:
    present = layer in record.layers
    return float(record.column("norm")[record.layers.index(layer)]) if present else math.nan


_SHOWN_LAYERS = 8
_DIGITS = re.compile(r"\d+")


def _merged(group: list[AlertEvent], depth: dict[str, int]) -> AlertEvent:
    """The events of one rule at one step as one, led by the culprit: for ``dead``, the
    deepest dead layer whose next layer still gets gradient (where the flow stops); for
    ``jump``, the weak side of the largest break; otherwise the layer furthest past its
    threshold (per-layer overrides may set different ones)."""

    def past_threshold(event: AlertEvent) -> float:
        return event.value / event.threshold if event.threshold else event.value

    if group[0].rule == "dead":
        stops = [e for e in group if "The flow stops here" in e.message] or group
        worst = max(stops, key=lambda e: depth.get(e.layer or "", -1))
    else:
        worst = (min if group[0].rule == "vanishing" else max)(group, key=past_threshold)
    layers = tuple(e.layer for e in group if e.layer is not None)
    others = [name for name in layers if name != worst.layer]
    listed = ", ".join(others[:_SHOWN_LAYERS])
    if len(others) > _SHOWN_LAYERS:
        listed += f" and {len(others) - _SHOWN_LAYERS} more"
    lead = "the culprit" if group[0].rule in ("dead", "jump") else "the worst"
    message = (
        f"{worst.rule} in {len(layers)} layers at once; {lead}: {worst.message} "
        f"The others: {listed}."
    )
    return worst.model_copy(update={"layers": layers, "message": message})
