"""The rules on the size of gradient norms, one layer or the total at a time.

- ``exploding``: a layer's gradient norm, or the total norm, above a threshold.
- ``vanishing``: a layer's gradient norm below a threshold (but not zero) for ``patience``
  logged steps in a row.
- ``dead``: a layer whose gradient is exactly zero for ``patience`` logged steps — dying
  ReLUs, saturated tanh/sigmoid units, or an unintended freeze.
- ``spike``: the total or a layer's gradient norm far above its recent typical value, as
  `gradtrack.capture.spike.NormWindow` flagged it on the device.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from gradtrack.alerts.book import Check, Cooldowns, RuleBook, Runs, counted
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord
from gradtrack.handoff.rules import PerStepRules


class ExplodingCheck(Check):
    """Words the layers and the total `PerStepRules` finds above their threshold, suggesting
    a clipping norm from ``total_norms``, the finite total norms seen so far."""

    def __init__(
        self,
        book: RuleBook,
        cooldowns: Cooldowns,
        total_norms: deque[float],
        per_step: PerStepRules,
    ) -> None:
        super().__init__(book, cooldowns)
        self.total_norms = total_norms
        self.per_step = per_step

    def layers(self, record: StepRecord, idx: np.ndarray) -> list[AlertEvent]:
        """Every layer above its threshold; Python work only for those."""
        norms, cols = record.column("norm"), idx + 1
        events: list[AlertEvent] = []
        for j in self.per_step.exploding(norms, cols).nonzero()[0]:
            events += self._event(record, record.layers[j], float(norms[j]), int(cols[j]))
        return events

    def total(self, record: StepRecord) -> list[AlertEvent]:
        """The total norm, if above its threshold."""
        norm, column = record.total_norm, np.zeros(1, np.int64)  # (column 0: the total)
        if not self.per_step.exploding(np.array([norm]), column)[0]:
            return []  # (non-finite norms belong to the nonfinite rule)
        return self._event(record, None, norm, 0)

    def _event(
        self, record: StepRecord, layer: str | None, norm: float, column: int
    ) -> list[AlertEvent]:
        threshold = float(self.per_step.explode_at[column])
        history = [n for n in self.total_norms if n <= threshold]
        clip = float(np.percentile(history, 90)) if history else threshold / 10
        name = f"gradient norm of {layer}" if layer else "total gradient norm"
        message = (
            f"{name} is {norm:.3g}, above {threshold:.3g}. Try: a lower learning rate, or "
            "clipping: torch.nn.utils.clip_grad_norm_(model.parameters(), "
            f"max_norm={clip:.2g}) (the 90th percentile of the total norms seen so far)."
        )
        statistic = "norm" if layer else "total_norm"
        return self.cooldowns.emit(
            record,
            "exploding",
            layer,
            statistic=statistic,
            value=norm,
            threshold=threshold,
            message=message,
        )


class VanishingCheck(Check):
    """Counts, per layer, the logged steps in a row its norm was below the threshold."""

    def __init__(self, book: RuleBook, cooldowns: Cooldowns) -> None:
        super().__init__(book, cooldowns)
        self._runs = Runs(len(book.names))

    def check(self, record: StepRecord, idx: np.ndarray) -> list[AlertEvent]:
        """The layers (``idx``: their positions in depth order) past their patience."""
        norms = record.column("norm")
        active = self.book.enabled("vanishing", idx) & np.isfinite(norms)
        threshold = self.book.param("vanishing", "threshold", idx)
        runs = self._runs.advance(idx, active, (norms > 0) & (norms < threshold))
        events: list[AlertEvent] = []
        for j in (active & (runs >= self.book.param("vanishing", "patience", idx))).nonzero()[0]:
            layer, norm = record.layers[j], float(norms[j])
            events += self.cooldowns.emit(
                record,
                "vanishing",
                layer,
                statistic="norm",
                value=norm,
                threshold=float(threshold[j]),
                message=(
                    f"gradient norm of {layer} is {norm:.3g}, below {threshold[j]:.3g} "
                    f"for {counted(int(runs[j]), 'logged step')}: it barely learns. Try: "
                    "residual connections, normalisation (LayerNorm/BatchNorm), a better "
                    "initialisation (Kaiming/Xavier), or non-saturating activations (ReLU/GELU "
                    "instead of sigmoid/tanh)."
                ),
            )
        return events


_SATURATED = (
    "Likely: saturated tanh/sigmoid units — their derivative is exactly 0 in "
    "float32 once |x| is large (tanh beyond ~9). Try: scaling or normalising the "
    "inputs, a smaller initialisation, LayerNorm before the nonlinearity, gradient "
    "clipping; or an unintended freeze (a .detach(), torch.no_grad() or "
    "requires_grad=False upstream of this layer)."
)
_DYING_RELU = (
    "Likely: dying ReLUs — every unit's input is negative. Try: LeakyReLU/GELU, a "
    "lower learning rate, and a bias initialisation that keeps units on (zero or "
    "slightly positive; a large negative bias switches them off); or an unintended "
    "freeze (a .detach(), torch.no_grad() or requires_grad=False upstream of this "
    "layer)."
)


class DeadCheck(Check):
    """``saturating``: per layer (depth order), whether zero gradients there read as
    saturated tanh/sigmoid rather than dead ReLUs (`gradtrack.capture.layers.saturating_layers`)."""

    def __init__(self, book: RuleBook, cooldowns: Cooldowns, saturating: Sequence[bool]) -> None:
        super().__init__(book, cooldowns)
        self._saturating = list(saturating)
        self._runs = Runs(len(book.names))

    def check(self, record: StepRecord, idx: np.ndarray) -> list[AlertEvent]:
        """The layers (``idx``: their positions in depth order) past their patience."""
        norms = record.column("norm")
        finite = np.isfinite(norms)
        active = self.book.enabled("dead", idx) & finite
        runs = self._runs.advance(idx, active, norms == 0.0)
        live = finite & (norms > 0)
        events: list[AlertEvent] = []
        for j in (active & (runs >= self.book.param("dead", "patience", idx))).nonzero()[0]:
            events += self._event(record, int(j), int(runs[j]), live)
        return events

    def _event(self, record: StepRecord, j: int, run: int, live: np.ndarray) -> list[AlertEvent]:
        layer = record.layers[j]
        # Where the flow stops: the deepest dead layer whose next layer still gets gradient.
        after = record.layers[j + 1] if j + 1 < len(record.layers) and live[j + 1] else None
        where = (
            f" The flow stops here: {after}, right after it, still gets gradient, so look at "
            f"what {layer} feeds (its activation) first."
            if after
            else ""
        )
        cause = _SATURATED if self._saturating[self.book.depth[layer]] else _DYING_RELU
        return self.cooldowns.emit(
            record,
            "dead",
            layer,
            statistic="norm",
            value=0.0,
            threshold=0.0,
            message=(
                f"gradient of {layer} has been exactly zero for "
                f"{counted(run, 'logged step')}.{where} {cause}"
            ),
        )


class SpikeCheck(Check):
    """Words the spikes of a step; the window's statistics come with the record."""

    def __init__(self, book: RuleBook, cooldowns: Cooldowns, per_step: PerStepRules) -> None:
        super().__init__(book, cooldowns)
        self.per_step = per_step

    def check(self, record: StepRecord) -> list[AlertEvent]:
        """The columns the every-step spike window flagged at this step, on the device (a
        step between logged ones reaches here when it spiked): the flags are the check, the
        same that ``skip`` and ``raise`` act on in the training thread."""
        if record.spiking is None or record.spike_z is None or record.spike_typical is None:
            return []
        events: list[AlertEvent] = []
        window = self.book.rules.spike.window
        for column in self.per_step.spiking(record.spiking).nonzero()[0]:
            layer = None if column == 0 else self.book.names[column - 1]
            z, typical = float(record.spike_z[column]), float(record.spike_typical[column])
            name = f"gradient norm of {layer}" if layer else "total gradient norm"
            norm = record.total_norm if layer is None else _layer_norm(record, layer)
            ratio = float(self.per_step.spike_ratio[column])
            events += self.cooldowns.emit(
                record,
                "spike",
                layer,
                statistic="norm" if layer else "total_norm",
                value=norm,
                threshold=typical * ratio,
                message=(
                    f"{name} spiked to {norm:.3g} at step {record.step}: "
                    f"{norm / typical:.1f}x its typical {typical:.3g} over the last {window} "
                    f"steps, {z:.1f} standard deviations above (log scale). Gradient-norm "
                    "spikes come before loss spikes: a bad batch (look at this step's data), "
                    "a learning rate too high for this phase (a longer warmup), or Adam's "
                    "epsilon too small. Try: clipping, or alerts={'spike': {'action': 'skip'}} "
                    "to leave such steps out."
                ),
            )
        return events


def _layer_norm(record: StepRecord, layer: str) -> float:
    present = layer in record.layers
    return float(record.column("norm")[record.layers.index(layer)]) if present else math.nan
