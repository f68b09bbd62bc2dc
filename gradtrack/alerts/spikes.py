"""The ``spike`` rule: the total or a layer's gradient norm far above its recent typical
value, as `gradtrack.capture.spike.NormWindow` flagged it on the device."""

from __future__ import annotations

import math

import numpy as np

from gradtrack.alerts.check import Check
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord


class SpikeCheck(Check):
    """Words the spikes of a step; the window's statistics come with the record."""

    def check(self, record: StepRecord) -> list[AlertEvent]:
        """The columns the every-step spike window flagged at this step, on the device (a
        step between logged ones reaches here when it spiked): the flags are the check, the
        same that ``skip`` and ``raise`` act on in the training thread."""
        if record.spiking is None or record.spike_z is None or record.spike_typical is None:
            return []
        events: list[AlertEvent] = []
        window = self.book.rules.spike.window
        for column in np.flatnonzero(record.spiking):
            layer = None if column == 0 else self.book.names[column - 1]
            z, typical = float(record.spike_z[column]), float(record.spike_typical[column])
            name = f"gradient norm of {layer}" if layer else "total gradient norm"
            norm = record.total_norm if layer is None else _layer_norm(record, layer)
            rule = self.book.rule("spike", layer)
            events += self.cooldowns.emit(
                record, "spike", layer, statistic="norm" if layer else "total_norm",
                value=norm, threshold=typical * rule.ratio,
                message=(
                    f"{name} spiked to {norm:.3g} at step {record.step}: "
                    f"{norm / typical:.1f}x its typical {typical:.3g} over the last {window} "
                    f"steps, {z:.1f} standard deviations above (log scale). Gradient-norm "
                    "spikes come before loss spikes: a bad batch (look at this step's data), "
                    "a learning rate too high for this phase (a longer warmup), or Adam's "
                    "epsilon too small. Try: clipping, or alerts={'spike': {'action': 'skip'}} "
                    "to leave such steps out."
                ),
            )  # fmt: skip
        return events


def _layer_norm(record: StepRecord, layer: str) -> float:
    present = layer in record.layers
    return float(record.column("norm")[record.layers.index(layer)]) if present else math.nan
